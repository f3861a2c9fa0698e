"""The reader between plan and loop: each rank's next micro-batches, fetched ahead in plan order.

The plan knows every rank's upcoming micro-batches, so a loader need not guess: `PlanFeed`
walks a copy of each local rank's sampler `depth` micro-batches ahead of the loop and hands
them, in that rank's plan order, to a `Reader`, which fetches them (dataset items, collated)
in background worker processes while the model computes. The trainer takes each micro-batch with
`get`; what it still waits for there is the load the step did not hide (`load_exposed_s` of
the per-step table) beside the fetch's own time (`load_s`).

A `Reader` is the seam (users may bring their own: one that reads from object storage, or
the test's recording reader): ``prefetch(batches)`` hears of upcoming micro-batches in plan
order, ``get(indices)`` returns one (fetching it now if it was not prefetched), ``cancel``
drops prefetches the loop will not take (after a jump in the plan: the replayed warm-up of
`steps: epoch`), ``close`` ends its workers. Two ship here: `InlineReader` (fetches in `get`,
on the loop's thread: nothing hidden) and `ProcessReader` (a pool of worker processes).

Bounded in memory: the feed keeps at most `depth` micro-batches per local rank queued or
ready, so a run holds at most depth x (local ranks) micro-batches beyond the one computing.
The feed announces each rank's first micro-batches when it is made (the trainer makes it
after restoring a checkpoint, so a resumed run's first ones: the feed starts from the
samplers' positions). The lookahead stops at the end of an epoch (the next epoch's plan is
made when the loop reaches it, as before), so the first micro-batch of each later epoch is
fetched while the loop waits.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from adaptiveload.data.dataset import LatentDataset
from adaptiveload.data.packed import PackedBatch, collate
from adaptiveload.planning.sampler import PlanBatch, PlanBatchSampler, PlanBuilder


@dataclass(frozen=True)
class Fetched:
    """One collated micro-batch; `fetch_s`, the time its fetch took in a worker (the reader's
    `clock` there: the worker's CPU time when the run's timer is thread time; 0 for a fetch
    on the loop's thread, which the loop's own timer counts); `blocked_s`, the wall time the
    loop waited in `get` for a worker still fetching it (0 when it was ready)."""

    batch: PackedBatch
    fetch_s: float = 0.0
    blocked_s: float = 0.0


class Reader(Protocol):
    def prefetch(self, batches: Sequence[PlanBatch]) -> None: ...

    def get(self, indices: PlanBatch) -> Fetched: ...

    def cancel(self, batches: Sequence[PlanBatch]) -> None: ...

    def close(self) -> None: ...


def fetch(dataset: LatentDataset, indices: PlanBatch) -> PackedBatch:
    """Read and collate one micro-batch, as its epoch sees it (caption dropout)."""
    epoch = indices.info.epoch
    return collate([dataset.item(i, epoch) for i in indices])


def key_of(indices: PlanBatch) -> tuple:
    """What identifies a micro-batch of the plan: where it sits and what it holds."""
    info = indices.info
    return info.epoch, info.step, info.rank, info.sp_rank, tuple(indices)


class InlineReader:
    """Fetches in `get`, on the loop's thread (the trainer before the reader seam)."""

    def __init__(self, dataset: LatentDataset):
        self.dataset = dataset

    def prefetch(self, batches: Sequence[PlanBatch]) -> None:
        pass

    def get(self, indices: PlanBatch) -> Fetched:
        return Fetched(fetch(self.dataset, indices))

    def cancel(self, batches: Sequence[PlanBatch]) -> None:
        pass

    def close(self) -> None:
        pass


class ProcessReader:
    """Fetches prefetched micro-batches in `workers` background processes, first asked first.

    Processes, not threads: a fetch is Python and torch calls that take the GIL, and every
    torch call of the loop gives it up, so a reader thread and the loop took turns on a
    busy CPU (a thread reader exposed 70-130% of the inline load in
    tests/bench/bench_reader.py, and slowed compute). The workers are forked with the dataset
    (spawned where fork is missing) and return the collated arrays through a pipe. `clock`
    (`time.thread_time` or `time.perf_counter`) is read in the worker."""

    def __init__(self, dataset: LatentDataset, workers: int, clock: Callable[[], float]):
        import multiprocessing

        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self._pool = ProcessPoolExecutor(
            workers,
            mp_context=context,
            initializer=_worker_init,
            initargs=(dataset, clock.__name__, os.getpid()),
        )
        self._pending: dict[tuple, Future[Fetched]] = {}

    def prefetch(self, batches: Sequence[PlanBatch]) -> None:
        for indices in batches:
            key = key_of(indices)
            if key not in self._pending:
                self._pending[key] = self._pool.submit(_worker_fetch, indices)

    def get(self, indices: PlanBatch) -> Fetched:
        future = self._pending.pop(key_of(indices), None)
        if future is None:  # not announced: fetch it now, in a worker
            future = self._pool.submit(_worker_fetch, indices)
        ready = future.done()
        t0 = time.perf_counter()
        result = future.result()  # a fetch's error surfaces here, in the loop
        return _received(result, 0.0 if ready else time.perf_counter() - t0)

    def cancel(self, batches: Sequence[PlanBatch]) -> None:
        for indices in batches:
            future = self._pending.pop(key_of(indices), None)
            if future is not None:
                future.cancel()

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


# a worker process's dataset and clock (ProcessReader)
_WORKER: dict[str, object] = {}


# how often a worker checks that the trainer that started it is alive (seconds)
ORPHAN_POLL_S = 0.1


def _worker_init(dataset: LatentDataset, clock: str, parent: int) -> None:
    import torch

    torch.set_num_threads(1)  # one core's work per worker, beside the loop's
    _WORKER.update(dataset=dataset, clock=getattr(time, clock))
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: int) -> None:
    """End this worker once the trainer that started it is gone. A trainer killed outright
    (SIGKILL, the OOM killer) never shuts its pool down, and a forked worker would live on
    holding the copies of its files it was born with, the run folder's lock among them, so
    the restarted trainer could not take the folder."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_S)
    os._exit(0)


def _worker_fetch(indices: PlanBatch) -> tuple:
    """The fetched micro-batch as numpy arrays, and the fetch's time on the worker's clock:
    the arrays travel through the pipe by value (one copy), cheaper for the loop to receive
    than one shared-memory file per tensor."""
    clock = _WORKER["clock"]
    t0 = clock()
    batch = fetch(_WORKER["dataset"], indices)
    latents = tuple(g.numpy() for g in batch.latents)
    return latents, batch.context.numpy(), batch.sample_ids, clock() - t0


def _received(result: tuple, blocked_s: float) -> Fetched:
    latents, context, sample_ids, fetch_s = result
    batch = PackedBatch(
        tuple(torch.from_numpy(g) for g in latents), torch.from_numpy(context), sample_ids
    )
    return Fetched(batch, fetch_s, blocked_s)


def make_reader(dataset: LatentDataset, workers: int, clock: Callable[[], float]) -> Reader:
    """The trainer's reader: `workers` processes (`train.reader_workers`), 0 = inline."""
    if workers == 0:
        return InlineReader(dataset)
    return ProcessReader(dataset, workers, clock)


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
        for rank in samplers:  # announced now, so the first step finds its inputs read
            self._ahead[rank] = self._walker(rank)
            self._top_up(rank)

    def load(self, rank: int, indices: PlanBatch) -> Fetched:
        """`indices` (the loop's next micro-batch of `rank`, just taken from its sampler)
        through the reader, after announcing the micro-batches that follow it."""
        queued = self._queued[rank]
        if queued and _same(queued[0], indices):
            queued.popleft()
        else:  # a new epoch, or the loop jumped in the plan: look ahead from here
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
