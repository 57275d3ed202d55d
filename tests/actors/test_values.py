"""Note [no cycles around tensors]: flattening and rebuilding a stage's value leaves nothing
that only Python's cyclic collector could free, so a microbatch's output (the logits and
their graph, on a last stage) goes the moment its slot is dropped."""

import gc
import weakref

import pytest
import torch

from actors.values import flatten, unflatten


def test_flatten_and_unflatten_keep_no_tensor_alive_once_dropped():
    gc.collect()
    gc.disable()  # only reference counting frees now, as between two collections on an actor
    try:
        t = torch.ones(4, requires_grad=True) * 2  # a non-leaf, as a stage's output is
        ref = weakref.ref(t)
        value = {"logits": t, "rest": [t[:2], (t[2:],)]}
        spec, tensors = flatten(value)
        rebuilt = unflatten(spec, tensors)
        assert rebuilt["logits"] is t and rebuilt["rest"][1][0].shape == (2,)
        del t, value, tensors, rebuilt
        assert ref() is None, "a reference cycle kept the stage output alive"
    finally:
        gc.enable()


def test_flatten_still_names_what_it_refuses():
    with pytest.raises(TypeError, match="stage 1 output is a int"):
        flatten({"x": [torch.ones(1), 3]}, where="stage 1 output")
