"""Helpers for the observability tests: scrape a server's /metrics into plain numbers."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Scrape:
    """One /metrics reading: sample name -> list of (labels, value)."""

    samples: dict[str, list[tuple[dict[str, str], float]]]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples named `name` whose labels include `labels` (0 when none)."""
        return sum(v for found, v in self.samples.get(name, []) if labels.items() <= found.items())

    def has(self, name: str) -> bool:
        return name in self.samples

    @property
    def names(self) -> set[str]:
        return set(self.samples)


def scrape(base_url: str) -> Scrape:
    reply = httpx.get(f"{base_url}/metrics", timeout=10)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return Scrape(samples)
