"""Note [Ray's method wrappers]: a worker's calls to its own private methods skip the
tracing shim Ray puts around every method of an actor class; calls through Ray keep it."""

from __future__ import annotations

from ray.util.tracing.tracing_helper import _inject_tracing_into_class

from actors.process import bypass_ray_wrappers

PRIVATE = "_private"  # the method under test, by name (private names are not reached into directly)


class Plain:
    def public(self, x):
        return self._private(x) + 1

    def _private(self, x):
        return 2 * x


def test_private_methods_are_bound_unwrapped_and_public_ones_keep_the_shim():
    class Actor(Plain):  # what ray.remote makes of a class: a subclass whose methods are wrapped
        pass

    _inject_tracing_into_class(Actor)
    assert getattr(Actor, PRIVATE).__ray_tracing_wrapped__ and Actor.public.__ray_tracing_wrapped__
    obj = Actor()
    bypass_ray_wrappers(obj)
    assert getattr(obj, PRIVATE).__func__ is getattr(Plain, PRIVATE)  # the method's own function
    assert "public" not in vars(obj) and obj.public(3) == 7
    plain = Plain()
    bypass_ray_wrappers(plain)  # outside Ray: nothing is wrapped, nothing bound
    assert not vars(plain)
