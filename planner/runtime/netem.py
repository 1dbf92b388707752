"""Bytes sent between ranks, and ``--emulate-link`` (a testing aid): slower links than loopback.

Loopback moves bytes far faster than any real link, so methods that save communication cannot show
their worth on one machine. While ``instrument`` is active, every point-to-point transfer and collective
of ``torch.distributed`` still really happens, and is also

* **counted**: ``Traffic.bytes_sent`` adds the tensor bytes this rank sends (a ring all-reduce sends
  ``2 (w - 1) / w`` of the tensor, a broadcast's source and an all-gather's ranks ``(w - 1)`` times
  their part, point-to-point sends their tensor); pickled-object collectives count through the tensor
  collectives they are built on;
* **slowed** when a link is emulated: the receiver of a point-to-point transfer of ``n`` bytes waits an
  extra ``latency + n / bandwidth`` after the real transfer completes (the sender, as on a real link,
  does not wait), and a blocking collective costs every rank the time its ring or tree would take on
  that link. Collectives share the rank's link one at a time: an asynchronous one (``async_op=True``)
  occupies it from when it starts (or the link frees) for its link time, and its ``wait`` returns no
  sooner than that, so compute done meanwhile hides it as a real link would. ``Traffic.emulated_s``
  sums the added time a rank actually waited.

Patching the module functions (``torch.distributed.distributed_c10d`` and the ``torch.distributed``
names bound to them) reaches the pipelining schedules' ``batch_isend_irecv`` and the object
collectives, which call these functions by their module-level names.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from planner.runtime.options import EmulatedLink

__all__ = ["Traffic", "instrument"]


@dataclass
class Traffic:
    """What this rank sent, and the time the emulated link added."""

    bytes_sent: int = 0
    emulated_s: float = 0.0


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(t) for t in tensors)
    return 0


class _DeadlineWork:
    """An asynchronous collective's work handle whose ``wait`` returns no sooner than the emulated link is done."""

    def __init__(self, work: Any, done_at: float, traffic: Traffic) -> None:
        self._work, self._done_at, self._traffic = work, done_at, traffic

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        _sleep(self._done_at - time.perf_counter(), self._traffic)
        self._done_at = 0.0
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _DelayedWork:
    """A receive's work handle whose ``wait`` also waits for the emulated link."""

    def __init__(self, work: Any, delay_s: float, traffic: Traffic) -> None:
        self._work, self._delay_s, self._traffic, self._waited = work, delay_s, traffic, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        if not self._waited:
            self._waited = True
            _sleep(self._delay_s, self._traffic)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _sleep(seconds: float, traffic: Traffic) -> None:
    if seconds > 0:
        time.sleep(seconds)
        traffic.emulated_s += seconds


@contextlib.contextmanager
def instrument(traffic: Traffic, link: EmulatedLink | None = None) -> Iterator[Traffic]:
    """Count (and, with ``link``, slow) this rank's transfers while active."""

    def p2p_s(nbytes: int) -> float:
        return link.latency_s + nbytes / link.bandwidth_Bps if link is not None else 0.0

    def world(group: Any) -> int:
        return dist.get_world_size(group)

    link_free = [0.0]  # when this rank's link finishes the collectives already started on it

    def wrap(name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> tuple[str, Any]:
        original = getattr(c10d, name)
        return name, (original, make(original))

    # ``send``/``recv`` may be built on ``isend``/``irecv`` (torch 2.13's are): count and delay once.
    def send(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            before = traffic.bytes_sent
            result = original(tensor, *args, **kwargs)
            if traffic.bytes_sent == before:
                traffic.bytes_sent += _nbytes(tensor)
            return result
        return call

    def recv(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            before = traffic.emulated_s
            result = original(tensor, *args, **kwargs)
            if traffic.emulated_s == before:
                _sleep(p2p_s(_nbytes(tensor)), traffic)
            return result
        return call

    def irecv(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            work = original(tensor, *args, **kwargs)
            return _DelayedWork(work, p2p_s(_nbytes(tensor)), traffic) if link is not None and work is not None else work
        return call

    def batch(original: Callable[..., Any]) -> Callable[..., Any]:
        """Backends without coalescing call the patched ``isend``/``irecv`` per op (counted and delayed
        there); coalescing ones (NCCL) return their own works, whose receives are delayed here."""
        def call(ops: Sequence[Any]) -> Any:
            works = original(ops)
            if link is None or len(works) != len(ops):
                return works
            return [_DelayedWork(w, p2p_s(_nbytes(op.tensor)), traffic)
                    if not isinstance(w, _DelayedWork) and op.op is getattr(c10d, "irecv") else w
                    for op, w in zip(ops, works)]
        return call

    def collective(share: Callable[[int, int, Any], tuple[float, float]]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """``share(nbytes, world, bound_args) -> (bytes this rank sends, link-seconds)`` for one collective."""

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                group = kwargs.get("group")
                w = world(group)
                sent, seconds = share(_nbytes(args[0] if args else kwargs.get("tensor")), w, (args, kwargs))
                traffic.bytes_sent += int(sent)
                began = time.perf_counter()
                result = original(*args, **kwargs)
                if link is None or w < 2:
                    return result
                start = began if kwargs.get("async_op") else time.perf_counter()  # blocking: after the real op
                done_at = max(start, link_free[0]) + seconds
                link_free[0] = done_at
                if kwargs.get("async_op"):
                    return _DeadlineWork(result, done_at, traffic) if result is not None else result
                _sleep(done_at - time.perf_counter(), traffic)
                return result
            return call
        return make

    def ring_all_reduce(n: int, w: int, _: Any) -> tuple[float, float]:
        return 2 * (w - 1) / w * n, 2 * (w - 1) * p2p_s(n // max(w, 1))

    def broadcast_share(n: int, w: int, bound: Any) -> tuple[float, float]:
        args, kwargs = bound
        src = kwargs.get("src", args[1] if len(args) > 1 else 0)
        me = dist.get_rank()
        return (n * (w - 1) if me == src else 0), p2p_s(n) * max(1, (w - 1).bit_length())

    def gather_share(n: int, w: int, bound: Any) -> tuple[float, float]:
        args, kwargs = bound
        part = _nbytes(args[1] if len(args) > 1 else kwargs.get("tensor", ()))
        return part * (w - 1), (w - 1) * p2p_s(part)

    patches = dict([
        wrap("send", send), wrap("isend", send), wrap("recv", recv), wrap("irecv", irecv),
        wrap("batch_isend_irecv", batch),
        wrap("all_reduce", collective(ring_all_reduce)), wrap("broadcast", collective(broadcast_share)),
        wrap("all_gather", collective(gather_share)), wrap("all_gather_into_tensor", collective(gather_share)),
    ])
    public = {name: getattr(dist, name) for name in patches if getattr(dist, name, None) is patches[name][0]}
    for name, (_, patched) in patches.items():
        setattr(c10d, name, patched)
        if name in public:
            setattr(dist, name, patched)
    try:
        yield traffic
    finally:
        for name, (original, _) in patches.items():
            setattr(c10d, name, original)
            if name in public:
                setattr(dist, name, original)
