from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

__version__: str

class Error(Exception):
    faults: list[tuple[int, str, str]]

class InvalidUsage(Error): ...
class PreconditionError(Error): ...
class TooManyFaults(Error): ...
class DisagreementError(Error):
    agreeing: list[int]
    disagreeing: list[int]
    unconfirmed: list[int]
    differing_inputs: list[int]
class TransportError(Error): ...
class ExcludedError(Error):
    kept: list[int]
class FellBehindError(Error):
    skipped_by: list[int]
class BootstrapError(Error): ...
class UnsupportedError(Error): ...

OUTLYING_SCORE: float

class Report:
    inputs: int
    faults: list[tuple[int, str, str]]
    non_finite: list[int]
    selected: Optional[list[int]]
    replicas: Optional[int]
    unauthenticated: bool
    identity: str
    erased_self: bool
    skipped_by: list[int]
    stragglers: int
    agreement: Optional[dict[str, list[int]]]
    peak_bytes: int
    bytes_sent: int
    bytes_received: int
    step_times_us: list[int]
    attribution: Optional[list[dict[str, Any]]]
    outlying: list[int]
    audit: Optional[dict[str, Any]]
    staged_bytes: int

class Communicator:
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def transport(self) -> str: ...
    def robust_all_reduce(
        self,
        x: Any,
        rule: str,
        f: int,
        *,
        policy: str = "gather",
        replicas: Optional[int] = None,
        m: Optional[int] = None,
        tau: Optional[float] = None,
    ) -> Report: ...
    def robust_reduce_scatter(
        self,
        input: Any,
        output: Any,
        rule: str,
        f: int,
        *,
        replicas: Optional[int] = None,
        m: Optional[int] = None,
        tau: Optional[float] = None,
    ) -> Report: ...
    def all_reduce(self, x: Any, op: str = "sum") -> None: ...
    def set_stragglers(self, stragglers: Union[str, int]) -> None: ...
    def set_step(self, step: Optional[int]) -> None: ...
    def health(self) -> list[dict[str, Any]]: ...
    def shrink(self) -> "Communicator": ...
    def admit(self) -> Optional[tuple["Communicator", list[int], int]]: ...
    @property
    def job_ranks(self) -> list[int]: ...
    @property
    def epoch(self) -> int: ...
    def barrier(self) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Communicator": ...
    def __exit__(self, *exc: Any) -> bool: ...

def init() -> Communicator: ...
def init_with_allgather(
    rank: int,
    size: int,
    allgather: Callable[[bytes], Sequence[bytes]],
    *,
    listen: Optional[str] = None,
    timeout_ms: Optional[int] = None,
) -> Communicator: ...
def init_mpi4py(comm: Any = None, *, listen: Optional[str] = None, timeout_ms: Optional[int] = None) -> Communicator: ...
def rules() -> list[tuple[str, str]]: ...
