"""What an integration routed to dimattn and what it left to the framework, counted
(dimattn.returnn, dimattn.transformers): thread-safe counters by outcome, with the
kernel of each routed call and the reason of each other one."""
from __future__ import annotations

import threading
from typing import Dict, Tuple


class RouteCounts:
    def __init__(self, outcomes: Tuple[str, ...]):
        self._lock = threading.Lock()
        self._counts = {k: 0 for k in outcomes}
        self._reasons: Dict[str, int] = {}
        self._kernels: Dict[str, int] = {}

    def stats(self) -> dict:
        """The counts by outcome, ``kernels`` (of routed calls) and ``reasons`` (of the others)."""
        with self._lock:
            return {**self._counts, "reasons": dict(self._reasons), "kernels": dict(self._kernels)}

    def reset(self) -> None:
        with self._lock:
            for k in self._counts:
                self._counts[k] = 0
            self._reasons.clear()
            self._kernels.clear()

    def count(self, outcome: str, detail: str) -> None:
        """detail: the kernel of a routed call, else the reason."""
        with self._lock:
            self._counts[outcome] += 1
            d = self._kernels if outcome == "routed" else self._reasons
            d[detail] = d.get(detail, 0) + 1
