"""The process pool the refit tests run producers and consumers in (spawned: each side a real process)."""
from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.refit import harness as H


@pytest.fixture(scope="module")
def pool():
    ex = ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn"), initializer=H.init_worker,
                             initargs=(None, None, None))
    yield ex
    ex.shutdown(wait=False, cancel_futures=True)
