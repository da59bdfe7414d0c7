"""Named workloads: the operator library (tasks.workloads) and any function registered with
`@workload("name")`, each returning [inputs..., outputs...], looked up and built by name."""
from __future__ import annotations

import inspect
from typing import Callable

from tensortune.tasks.compute_dag import ComputeDAG
from tensortune.tasks.te import Tensor
from tensortune.tasks.workloads import LIBRARY

_REGISTRY: dict[str, Callable[..., list[Tensor]]] = dict(LIBRARY)


class UnknownWorkload(KeyError):
    def __str__(self) -> str:
        return self.args[0]


def workload(name: str) -> Callable:
    def register(fn: Callable[..., list[Tensor]]) -> Callable[..., list[Tensor]]:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"workload {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn
    return register


def workload_names() -> list[str]:
    return sorted(_REGISTRY)


def workload_function(name: str) -> Callable[..., list[Tensor]]:
    if name not in _REGISTRY:
        raise UnknownWorkload(f"unknown workload {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def workload_signature(name: str) -> inspect.Signature:
    return inspect.signature(workload_function(name))


def make_dag(name: str, *args, **kwargs) -> ComputeDAG:
    """Build the DAG of a registered workload; bad arguments name the parameter that is wrong."""
    fn = workload_function(name)
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"workload {name}{inspect.signature(fn)}: {err}") from None
    bound.apply_defaults()
    tensors = fn(*bound.args, **bound.kwargs)
    return ComputeDAG(tensors, name=name)
