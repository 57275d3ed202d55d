"""Prepared token files read by step: the order of ``mpmd train``'s sequences and the feed
that lets each actor read its own rows (``prepare.py`` writes the files).

Note [data order]
The prepared tokens are one stream (every document's tokens, then EOS, in corpus order)
cut into ``n = tokens // seq_len`` sequences, the tail dropped.  A keyed bijection of
``range(n)`` (``Permutation``: a Feistel network over the next even power of two with
cycle walking, so any index is mapped in O(1) time and memory) decides everything:

* the split, keyed by (seed, 2**31): sequences ``split(0) .. split(val - 1)`` are the
  validation set, training sequence ``j`` is ``split(val + j)``;
* an epoch's order, keyed by (seed, epoch): position ``p`` of epoch ``e`` is training
  sequence ``order_e(p)``; step ``s`` is epoch ``s // per_epoch`` and takes its
  positions ``(s % per_epoch) * batch_size + [0, batch_size)``.

So the batch of step ``s`` is a pure function of (seed, s) that any process computes
from the step number alone, without an O(corpus) permutation: the controller sends the
actors nothing but the step, and a run resumed at step ``s`` takes exactly the batches the
uninterrupted one took from ``s`` on.

Note [actors read their rows]
In ``mpmd train`` every actor that needs a step's batch reads it itself (``TokenFeed``, a
feed in the sense of Note [fed steps] in actors/feed.py): each tensor-parallel rank of a
replica's first stage reads the replica's input rows, and each rank of its last stage the
target rows (for a causal LM the same rows; V-shaped schedules read once for both).  A
replica's rows are ``[replica * batch_size / dp, (replica + 1) * batch_size / dp)`` of the
step's batch, cut into microbatches as the controller would cut them.  Nothing travels
between actors for it, so TP ranks and dp replicas need no extra messages, and the
controller's memory does not grow with the corpus.  Every actor must see the prepared
directory: on one node it is local; across nodes ``data.prepared_dir`` must be a
filesystem every node mounts, checked when the feeds are attached, before the first step.

Note [shifted targets]
At ``parallel.cp = 1`` the targets are the rows themselves and ``causal_lm_loss`` shifts them
(position ``t`` predicts token ``t + 1``).  At ``cp > 1`` each sequence is cut into zigzag
shards on the actors (docs/context.md), and a shift inside the loss would cross the shards'
boundaries, so the runtime refuses ``causal_lm_loss``: the targets are shifted here, on the
whole row (``targets[t] = ids[t + 1]``, -100 at the end), and the loss is
``next_token_loss``, the same cross-entropy without the shift.  Both give the same numbers.
With ``data.document_mask`` the controller sends each step's rows with their documents'
positions (``document_positions``, a side input every stage's actors take), as fed steps
carry no side inputs.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import socket
from typing import Any, Callable, Optional

import numpy as np
import torch

from actors.feed import chunk
from actors.file_checks import open_regular, plain_name, regular_stat

__all__ = ["Permutation", "PreparedTokens", "TokenOrder", "TokenFeed", "INDEX", "TOKEN_DTYPES", "lm_targets",
           "document_positions"]

INDEX = "index.json"
_OPEN_MAPS = 256
TOKEN_DTYPES = ("uint16", "uint32")  # what prepare.py writes (by vocabulary size); nothing else is read
_ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _redo(directory: str) -> str:
    return f"delete {directory} and run `mpmd prepare-data CONFIG` again"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_index(path: str, index: Any, fix: str) -> np.dtype:
    """The token dtype of a prepared directory's ``index.json`` (read from ``path``), after
    checking every entry later used to open or size a file: the dtype one ``prepare.py``
    writes (another, say "O", would make numpy read the file's bytes as pointers), each
    shard's ``file`` and ``docs`` plain names of the directory (Note [names from files] in
    actors/file_checks.py), its counts whole numbers."""
    if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
        raise ValueError(f"{path} is not a prepared-data index (an object with a list of \"shards\"); {fix}")
    dtype = index.get("dtype")
    if not isinstance(dtype, str) or dtype not in TOKEN_DTYPES:
        raise ValueError(f"{path}: dtype {dtype!r} is not a token dtype mpmd prepare-data writes "
                         f"({', '.join(TOKEN_DTYPES)}); {fix}")
    for i, shard in enumerate(index["shards"]):
        if not isinstance(shard, dict):
            raise ValueError(f"{path}: shards[{i}] is {shard!r}, not an object; {fix}")
        plain_name(shard.get("file"), ".bin", where=f"{path}: shards[{i}].file", fix=fix)
        plain_name(shard.get("docs"), ".idx", where=f"{path}: shards[{i}].docs", fix=fix)
        for key in ("tokens", "documents"):
            if not _count(shard.get(key)):
                raise ValueError(f"{path}: shards[{i}].{key} is {shard.get(key)!r}, not a count; {fix}")
    return np.dtype(dtype)


def lm_targets(ids: torch.Tensor, shift: bool) -> torch.Tensor:
    """The targets of a batch of token rows (Note [shifted targets]): the rows themselves
    (``causal_lm_loss`` shifts them), or shifted here (``next_token_targets``)."""
    if not shift:
        return ids
    from ..planning.hf import next_token_targets

    return next_token_targets(ids)


def document_positions(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """Each token's position in its document (``[rows, seq]``): 0 at a row's first token and
    after every ``eos`` (the prepared stream is every document's tokens, then EOS), counting up
    until the next; what ``Pipeline(document_mask=True)`` takes as ``position_ids``."""
    at = torch.arange(ids.shape[-1]).expand_as(ids)
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = ids[..., :-1] == eos
    return at - torch.where(starts, at, 0).cummax(dim=-1).values


class Permutation:
    """A pseudo-random bijection of ``range(n)`` keyed by ``key`` (Note [data order])."""

    def __init__(self, n: int, key: tuple) -> None:
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        bits = max(2, (n - 1).bit_length())
        self.n, self.half = n, (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.default_rng(list(key)).integers(0, 2 ** 63, size=_ROUNDS, dtype=np.uint64)

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << half) | right

    def __call__(self, index: Any) -> np.ndarray:
        x = np.asarray(index, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"an index outside range({self.n})")
        out = self._round_trip(x.astype(np.uint64))
        outside = out >= np.uint64(self.n)
        while outside.any():  # cycle walking: the walk from an index below n comes back below n
            out[outside] = self._round_trip(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


class PreparedTokens:
    """A prepared directory's token stream, memory-mapped (``prepare.py`` writes it).

    ``index`` is its ``index.json``; ``check()`` compares every file with it, and
    ``read(start, count)`` gives ``count`` tokens from global position ``start`` as int64."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        path = os.path.join(directory, INDEX)
        try:
            with open_regular(path, "r", where=f"prepared data {directory}", fix=_redo(directory)) as f:
                self.index = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such file on {socket.gethostname()}: {directory} is not prepared "
                                    f"data here; run `mpmd prepare-data CONFIG` (across nodes, data.prepared_dir "
                                    f"must be a filesystem every node mounts)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not JSON ({e}); {_redo(directory)}") from None
        self.dtype = _check_index(path, self.index, _redo(directory))
        counts = [s["tokens"] for s in self.index["shards"]]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.tokens = int(self.starts[-1])
        self._maps: collections.OrderedDict = collections.OrderedDict()  # shard -> memmap, the latest used last

    def check(self) -> None:
        """Every shard present, a regular file, with the size the index gives (ValueError naming
        the file)."""
        fix = _redo(self.directory)
        for shard in self.index["shards"]:
            for name, size in ((shard["file"], shard["tokens"] * self.dtype.itemsize),
                               (shard["docs"], shard["documents"] * 8)):
                st = regular_stat(os.path.join(self.directory, name), where=f"prepared data {self.directory}",
                                  fix=fix)
                got = None if st is None else st.st_size
                if got != size:
                    state = "missing" if got is None else f"{got} bytes where the index says {size}"
                    raise ValueError(f"prepared data {self.directory}: {name} is {state} (on "
                                     f"{socket.gethostname()}); {fix}")

    def _map(self, shard: int) -> np.ndarray:
        """Shard ``shard`` memory-mapped; at most ``_OPEN_MAPS`` stay mapped (a process's maps are
        limited: vm.max_map_count), the least recently used unmapped first."""
        found = self._maps.get(shard)
        if found is None:
            s = self.index["shards"][shard]
            if s["tokens"]:
                path = os.path.join(self.directory, s["file"])  # a plain name: _check_index
                with open_regular(path, where=f"prepared data {self.directory}",
                                  fix=_redo(self.directory)) as f:  # the map keeps its own descriptor
                    found = np.memmap(f, dtype=self.dtype, mode="r", shape=(s["tokens"],))
            else:
                found = np.zeros(0, self.dtype)
            self._maps[shard] = found
            if len(self._maps) > _OPEN_MAPS:
                self._maps.popitem(last=False)
        self._maps.move_to_end(shard)
        return found

    def read(self, start: int, count: int) -> np.ndarray:
        out, at = np.empty(count, dtype=np.int64), 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while at < count:
            lo = start + at - int(self.starts[shard])
            piece = self._map(shard)[lo:lo + count - at]
            out[at:at + len(piece)] = piece
            at += len(piece)
            shard += 1
        return out

    @property
    def mapped(self) -> int:
        """How many shards are memory-mapped now."""
        return len(self._maps)

    def close(self) -> None:
        self._maps.clear()

    def __getstate__(self) -> dict:  # shipped without its maps; each process maps its own
        return {**self.__dict__, "_maps": collections.OrderedDict()}


@dataclasses.dataclass
class TokenOrder:
    """Which sequences make each step's batch and the validation set (Note [data order])."""

    sequences: int  # tokens // seq_len
    seq_len: int
    batch_size: int  # sequences per step, all replicas together
    val: int  # held-out sequences
    seed: int

    def __post_init__(self) -> None:
        self.train = self.sequences - self.val
        self.per_epoch = self.train // self.batch_size
        self.split = Permutation(self.sequences, (self.seed, 2 ** 31))  # validation, then training
        self._epoch: Optional[tuple[int, Permutation]] = None

    def _order(self, epoch: int) -> Permutation:
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, Permutation(self.train, (self.seed, epoch)))
        return self._epoch[1]

    def train_sequences(self, step: int, lo: int = 0, hi: Optional[int] = None) -> np.ndarray:
        """Rows ``[lo, hi)`` of step ``step``'s batch, as sequence indices."""
        epoch, j = divmod(step, self.per_epoch)
        positions = j * self.batch_size + np.arange(lo, self.batch_size if hi is None else hi)
        return self.split(self.val + self._order(epoch)(positions))

    def val_sequences(self) -> np.ndarray:
        return self.split(np.arange(self.val))

    def rows(self, tokens: PreparedTokens, sequences: np.ndarray) -> torch.Tensor:
        """The token rows of ``sequences``, (len, seq_len) int64."""
        L = self.seq_len
        return torch.from_numpy(np.stack([tokens.read(int(s) * L, L) for s in sequences]))


class TokenFeed:
    """On a first- or last-stage actor: each fed step's rows, read by step number from the
    prepared files (Note [actors read their rows]); the ``Feed`` interface of actors/feed.py."""

    def __init__(self, tokens: PreparedTokens, order: TokenOrder, *, replica: int, dp: int, parts: int,
                 inputs: bool, targets: bool, shift: bool = False) -> None:
        self.tokens, self.order, self.parts, self.shift = tokens, order, parts, shift
        per = order.batch_size // dp
        self.rows = (replica * per, (replica + 1) * per)
        self.inputs, self.targets = inputs, targets

    def start(self) -> None:
        self.tokens.check()  # on this actor's node, before the first step

    def close(self) -> None:
        self.tokens.close()

    def pull(self, comm, prepare: Optional[Callable] = None, step: int = 0) -> tuple[Optional[list], Optional[list]]:
        ids = self.order.rows(self.tokens, self.order.train_sequences(step, *self.rows))
        keep = prepare or (lambda v: v)
        mbs = chunk(keep(ids), self.parts)
        targets = None
        if self.targets:
            targets = chunk(keep(lm_targets(ids, True)), self.parts) if self.shift else mbs
        return (mbs if self.inputs else None), targets


class TokenData:
    """``mpmd train``'s data as the controller sees it: counts, the validation batches, a batch by
    step (``auto``'s sample, tests), and the actors' feeds; it holds no tokens of the corpus."""

    def __init__(self, tokens: PreparedTokens, *, seq_len: int, batch_size: int, val_fraction: float,
                 eval_batches: int, seed: int, shift_targets: bool = False, eos: Optional[int] = None) -> None:
        n = tokens.tokens // seq_len
        val = min(eval_batches, max(1, round(val_fraction * n / batch_size))) * batch_size
        if n - val < batch_size:
            raise ValueError(f"the training files give {n} sequences of {seq_len} tokens ({tokens.tokens} tokens in "
                             f"{tokens.directory}): too few for a validation batch and a training batch of "
                             f"optim.batch_size={batch_size}; add data, or lower optim.batch_size or data.seq_len")
        self.tokens = tokens
        self.order = TokenOrder(n, seq_len, batch_size, val, seed)
        # Note [shifted targets]; eos: the documents' positions are passed (data.document_mask)
        self.shift_targets, self.eos = shift_targets, eos

    per_epoch = property(lambda self: self.order.per_epoch)
    train_sequences = property(lambda self: self.order.train)
    val_sequences = property(lambda self: self.order.val)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.order.rows(self.tokens, self.order.train_sequences(step))
        return ids, lm_targets(ids, self.shift_targets)

    def val_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids = self.order.rows(self.tokens, self.order.val_sequences())
        return [(b, lm_targets(b, self.shift_targets)) for b in ids.split(self.order.batch_size)]

    def side(self, ids: torch.Tensor) -> dict:
        """A batch's side inputs: with document masking (``eos`` given) its ``position_ids``."""
        return {} if self.eos is None else {"position_ids": document_positions(ids, self.eos)}

    def attach(self, engine) -> None:
        """Give every actor that needs a step's batch its ``TokenFeed`` (Note [actors read their
        rows]); from now on a step issued with ``FED`` carries no data.  A node that cannot read
        the prepared files fails here, before the first step."""
        cfg, grid = engine.config, engine.grid
        first, last = engine.schedule.stage_to_rank[0], engine.schedule.stage_to_rank[-1]
        feeds = {}
        for i in range(grid.size):
            replica, rank, _ = grid.coord(i)
            if rank in (first, last):
                feeds[i] = TokenFeed(self.tokens, self.order, replica=replica, dp=cfg.layout.dp,
                                     parts=engine.schedule.num_microbatches,
                                     inputs=rank == first, targets=rank == last, shift=self.shift_targets)
        engine.client.attach_feeds(feeds, "handing out the data")
