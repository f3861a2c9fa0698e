"""Emulated CPU ranks are timed by the computing thread's CPU time, beside the wall clock, and
every output says which clock it used: the per-step table, the summary, the label the
analysis gives the run and the MLflow run's `timer` tag. No assertion on speed: only on what
must hold however busy the machine is."""

from __future__ import annotations

from adaptiveload.training.distributed import CUDA_EVENTS, THREAD_TIME, WALL, timer_of


def test_timer_of_each_launch():
    assert timer_of("emulated", "cpu") == THREAD_TIME
    assert timer_of("distributed", "cpu") == WALL
    assert timer_of("emulated", "cuda") == timer_of("distributed", "cuda") == CUDA_EVENTS
