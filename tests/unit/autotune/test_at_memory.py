"""The autotuner's ``memory`` metric: the CUDA allocator's peak once the trial used a GPU, else the peak RSS."""

from __future__ import annotations

import resource

import pytest
import torch

from elasticzero.autotune.window import MeasureWindow, memory_source


def test_memory_source_is_cuda_only_once_cuda_was_used() -> None:
    assert memory_source(cuda_available=True, cuda_initialized=True) == "cuda"
    assert memory_source(cuda_available=True, cuda_initialized=False) == "rss"  # a GPU node, a CPU trial
    assert memory_source(cuda_available=False, cuda_initialized=False) == "rss"


def test_cpu_trial_reports_its_peak_rss() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("this process used CUDA: its memory metric is the allocator's peak")
    window = MeasureWindow(warmup=0, steps=1)
    window._marks = [(0.0, 0), (1.0, 4)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    memory = window.metrics()["memory"]
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert before <= memory <= after  # the peak only grows: read between two readings of it
