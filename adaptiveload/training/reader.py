"""The reader between plan and loop: each rank's next micro-batches, fetched ahead in plan order.

The plan knows every rank's upcoming micro-batches, so a loader need not guess: `PlanFeed`
walks a copy of each local rank's sampler `depth` micro-batches ahead of the loop and hands
them, in that rank's plan order, to a `Reader`, which fetches them (dataset items, collated)
on background threads while the model computes. The trainer takes each micro-batch with
`get`; what it still waits for there is the load the step did not hide (`load_exposed_s` of
the per-step table) beside the fetch's own time (`load_s`).

A `Reader` is the seam (users may bring their own: one that reads from object storage, or
the test's recording reader): ``prefetch(batches)`` hears of upcoming micro-batches in plan
order, ``get(indices)`` returns one (fetching it now if it was not prefetched), ``cancel``
drops prefetches the loop will not take (after a jump in the plan: the replayed warm-up of
`steps: epoch`), ``close`` ends its threads. Two ship here: `InlineReader` (fetches in `get`,
the loop's thread: nothing hidden) and `ThreadReader` (a pool of worker threads).

Bounded in memory: the feed keeps at most `depth` micro-batches per local rank queued or
ready, so a run holds at most depth x (local ranks) micro-batches beyond the one computing.
The lookahead stops at the end of an epoch (the next epoch's plan is made when the loop
reaches it, as before); the first micro-batch of each epoch and of a resumed run is then
fetched while the loop waits. Resuming needs nothing of the reader: the feed starts from
the restored samplers' positions.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from adaptiveload.data.dataset import LatentDataset
from adaptiveload.data.packed import PackedBatch, collate
from adaptiveload.planning.sampler import PlanBatch, PlanBatchSampler, PlanBuilder


@dataclass(frozen=True)
class Fetched:
    """One collated micro-batch and the time its fetch took where it ran (the reader's
    `clock`: the fetching thread's CPU time when the run's timer is thread time)."""

    batch: PackedBatch
    fetch_s: float


class Reader(Protocol):
    def prefetch(self, batches: Sequence[PlanBatch]) -> None: ...

    def get(self, indices: PlanBatch) -> Fetched: ...

    def cancel(self, batches: Sequence[PlanBatch]) -> None: ...

    def close(self) -> None: ...


def fetch(dataset: LatentDataset, indices: PlanBatch, clock: Callable[[], float]) -> Fetched:
    """Read and collate one micro-batch, as its epoch sees it (caption dropout)."""
    t0 = clock()
    epoch = indices.info.epoch
    batch = collate([dataset.item(i, epoch) for i in indices])
    return Fetched(batch, clock() - t0)


def key_of(indices: PlanBatch) -> tuple:
    """What identifies a micro-batch of the plan: where it sits and what it holds."""
    info = indices.info
    return info.epoch, info.step, info.rank, info.sp_rank, tuple(indices)


class InlineReader:
    """Fetches in `get`, on the loop's thread (the trainer before the reader seam)."""

    def __init__(self, dataset: LatentDataset, clock: Callable[[], float] = time.perf_counter):
        self.dataset, self.clock = dataset, clock

    def prefetch(self, batches: Sequence[PlanBatch]) -> None:
        pass

    def get(self, indices: PlanBatch) -> Fetched:
        return fetch(self.dataset, indices, self.clock)

    def cancel(self, batches: Sequence[PlanBatch]) -> None:
        pass

    def close(self) -> None:
        pass


class ThreadReader:
    """Fetches prefetched micro-batches on `workers` background threads, first asked first.

    Threads, not processes: reading a safetensors file and copying tensors release the GIL,
    and a thread shares the dataset (its text-embedding cache) without pickling. `clock`
    runs in the worker (`time.thread_time` there is the worker's own CPU time)."""

    def __init__(
        self, dataset: LatentDataset, workers: int, clock: Callable[[], float] = time.perf_counter
    ):
        self.dataset, self.clock = dataset, clock
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="adaptiveload-reader")
        self._pending: dict[tuple, Future[Fetched]] = {}

    def prefetch(self, batches: Sequence[PlanBatch]) -> None:
        for indices in batches:
            key = key_of(indices)
            if key not in self._pending:
                self._pending[key] = self._pool.submit(fetch, self.dataset, indices, self.clock)

    def get(self, indices: PlanBatch) -> Fetched:
        future = self._pending.pop(key_of(indices), None)
        if future is None:  # not announced: fetch it now
            return fetch(self.dataset, indices, self.clock)
        return future.result()  # a fetch's error surfaces here, in the loop

    def cancel(self, batches: Sequence[PlanBatch]) -> None:
        for indices in batches:
            future = self._pending.pop(key_of(indices), None)
            if future is not None:
                future.cancel()

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)


def make_reader(dataset: LatentDataset, workers: int, clock: Callable[[], float]) -> Reader:
    """The trainer's reader: `workers` threads (`train.reader_workers`), 0 = inline."""
    if workers == 0:
        return InlineReader(dataset, clock)
    return ThreadReader(dataset, workers, clock)


class PlanFeed:
    """Each local rank's upcoming micro-batches, from a copy of its sampler, announced to the
    reader `depth` ahead of the loop in that rank's plan order (module docstring)."""

    def __init__(
        self,
        reader: Reader,
        builder: PlanBuilder,
        samplers: Mapping[int, PlanBatchSampler],
        depth: int,
    ):
        """`samplers`: the loop's, one per local rank, planned by `builder`; read, never
        advanced (their positions are what a checkpoint saves)."""
        self.reader, self.builder, self.samplers, self.depth = reader, builder, samplers, depth
        self._queued: dict[int, deque[PlanBatch]] = {r: deque() for r in samplers}
        self._ahead: dict[int, Iterator[PlanBatch]] = {}

    def load(self, rank: int, indices: PlanBatch) -> Fetched:
        """`indices` (the loop's next micro-batch of `rank`, just taken from its sampler)
        through the reader, after announcing the micro-batches that follow it."""
        queued = self._queued[rank]
        if queued and _same(queued[0], indices):
            queued.popleft()
        else:  # first call, a resume, or the loop jumped in the plan: look ahead from here
            self.reader.cancel(list(queued))
            queued.clear()
            self.reader.prefetch([indices])
            self._ahead[rank] = self._walker(rank)
        self._top_up(rank)
        return self.reader.get(indices)

    def _walker(self, rank: int) -> Iterator[PlanBatch]:
        """The rest of `rank`'s current epoch after the batch its sampler handed out last."""
        sampler = self.samplers[rank]
        shadow = PlanBatchSampler(self.builder, rank, epoch=sampler.epoch)
        shadow.load_state_dict(sampler.state_dict())
        return iter(shadow)

    def _top_up(self, rank: int) -> None:
        queued = self._queued[rank]
        ahead = self._ahead[rank]
        new = []
        while len(queued) < self.depth:
            nxt = next(ahead, None)
            if nxt is None:  # the epoch's end: the next plan is made when the loop gets there
                break
            queued.append(nxt)
            new.append(nxt)
        if new:
            self.reader.prefetch(new)

    def close(self) -> None:
        self.reader.close()


def _same(a: PlanBatch, b: PlanBatch) -> bool:
    return a.info == b.info and list(a) == list(b)
