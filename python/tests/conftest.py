import os

import pytest

import byzcoll
from helpers import is_launcher_var


@pytest.fixture()
def world_of_one(monkeypatch):
    """A communicator of one rank, joined from BYZCOLL_RANK=0, BYZCOLL_WORLD_SIZE=1 alone."""
    for k in list(os.environ):
        if is_launcher_var(k):
            monkeypatch.delenv(k)
    monkeypatch.setenv("BYZCOLL_RANK", "0")
    monkeypatch.setenv("BYZCOLL_WORLD_SIZE", "1")
    comm = byzcoll.init()
    yield comm
    comm.close()
