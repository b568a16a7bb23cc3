"""What a NATS cluster's monitoring port says about JetStream (tests that stop nodes need it)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable


def meta_leader(http_ports: Iterable[int]) -> str | None:
    """The node leading the JetStream meta group (what every JetStream API call needs), from the
    first live node's /jsz that names one; None when none does (an election)."""
    for port in http_ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/jsz", timeout=2) as resp:
                leader = (json.loads(resp.read()).get("meta_cluster") or {}).get("leader")
        except OSError:
            continue
        if leader:
            return str(leader)
    return None
