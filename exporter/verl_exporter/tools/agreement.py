"""Does the in-process circuit breaker agree with the alert pack? One run, replayed both ways: the generated
rules in promtool (the pack's pages) and ``CircuitBreaker.from_spec`` fed the same lines on the same simulated
clock (the steps' end times, and a tick every scrape between them, as the Monitor's worker would give it).

The breaker must trip if and only if the pack pages a critical alert it judges (``judged_alerts``), and no
later than ``MAX_LAG_STEPS`` steps after that page. ``bench/breaker_agreement.py`` prints the table for every
scenario and every run of the real-run corpus; the tests assert it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import Spec
from ..trainer.breaker import CircuitBreaker, judged_alerts
from . import replay as rp

MAX_LAG_STEPS = 3  # the most steps the breaker may trip after the pack's first critical page

@dataclass
class Agreement:
    page: str | None  # the pack's first critical page among the alerts the breaker judges
    page_step: int | None
    trip: str | None  # the alert that tripped the breaker
    trip_step: int | None

    @property
    def lag(self) -> int | None:
        """Steps from the page to the trip (negative: the breaker tripped first)."""
        return None if self.page_step is None or self.trip_step is None else self.trip_step - self.page_step

    @property
    def agrees(self) -> bool:
        if self.page is None or self.trip is None:
            return self.page is None and self.trip is None
        return self.lag <= MAX_LAG_STEPS


def breaker_on(lines: list[dict], samples: rp.Samples, spec: Spec) -> CircuitBreaker:
    """The breaker after the run: each line observed at its step's end, ticks every scrape in between and
    after the last line (until the last scrape), so a hang is judged as the Monitor's worker would."""
    b = CircuitBreaker.from_spec(spec)
    tick, end = samples.scrape_s, (samples.length - 1) * samples.scrape_s
    for (step, at), line in zip(samples.step_end_s, lines, strict=True):
        while tick < at and b.tripped is None:
            b.tick(tick)
            tick += samples.scrape_s
        b.observe(step, line["data"], now=at)
    while tick <= end and b.tripped is None:
        b.tick(tick)
        tick += samples.scrape_s
    return b


def agreement(lines: list[dict], samples: rp.Samples, fired: list[rp.Firing], spec: Spec) -> Agreement:
    judged = {a.alert for a in judged_alerts(spec)[0]}
    pages = sorted((f.minute, f.alert) for f in fired if f.severity == "critical" and f.alert in judged)
    page = pages[0] if pages else None
    trip = breaker_on(lines, samples, spec).tripped
    return Agreement(page[1] if page else None, rp.step_at(samples, page[0]) if page else None,
                     trip.alert if trip else None, trip.step if trip else None)
