# Sourced by gpu-check.sh: start_mps sets MPS to what CUDA MPS is doing for this check, starting
# the control daemon when it is installed and not running (and stopping it at exit).
# `nvidia-cuda-mps-control -d` returns once the daemon forks, not once it serves, so a started
# daemon counts only once it answers.

start_mps() {
    if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
        MPS="not available (no nvidia-cuda-mps-control: kernels of different actors time-slice)"
        return
    fi
    if echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
        MPS="running already"
        return
    fi
    if ! nvidia-cuda-mps-control -d >/dev/null 2>&1; then
        MPS="nvidia-cuda-mps-control -d failed (not running: kernels of different actors time-slice)"
        return
    fi
    trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
    local tries
    for tries in 1 2 3 4 5 6 7 8 9 10; do
        if echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
            MPS="started for this check"
            return
        fi
        sleep "${MPS_WAIT_S:-0.5}"
    done
    MPS="nvidia-cuda-mps-control -d returned but the daemon never answered (kernels of different actors time-slice)"
}
