"""The decode ceilings ``colibri plan`` sets beside the user's target: one machine, and
a llama.cpp RPC cluster of hosts like this one.

Why ceilings, not promises: DESIGN §8's roofline. A decoded token must read its weights
once; no engine beats (bytes a token reads) / (bandwidth it reads them at). On one
machine that is the memory bus for what stays in RAM and the drive for the experts that
do not; the share of a token's experts that must come from the drive depends on the
routing, which a plan cannot know, so the streamed figure assumes every expert equally
likely (the cache then holds its share of the experts and hits in that proportion). A
trained model's routing is skewed, so its cache hits more often: ``colibri bench stream``
measures the real figure once the model runs here.

A llama.cpp RPC cluster splits the layers across its hosts: each holds its share of the
weights in RAM and one request's token visits them in turn, so on hosts like this one the
ceiling of one stream is this machine's memory bus over the bytes a token reads, less
one network round trip per host per token (the network is not measured here). What more
hosts buy is room: a model that streams from one drive becomes resident, and the room
left serves more concurrent requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibrid.cluster.measure import Figure, Measured
from colibrid.store.budget import GiB, reserve_for


@dataclass(frozen=True)
class Ceiling:
    """A decode ceiling in tokens a second, what bounds it, and how it was reached."""

    tok_s: float
    bound: str  # "memory", "disk", or "RAM" (0 tok/s: the model cannot run)
    how: str


def per_host_need(m: Measured, hosts: int) -> int:
    """Bytes each of ``hosts`` equal hosts keeps in RAM: its share of the weights and of
    the KV cache at the daemon's default context."""
    return -(-(int(m.weights.value) + m.report.kv_bytes) // hosts)


def usable(ram: Figure) -> int:
    """The RAM budget less the daemon's reserve (Python, the page cache)."""
    total = int(ram.value)
    return total - reserve_for(total)


def hosts_needed(m: Measured) -> int:
    """The fewest hosts like this one that keep every weight in RAM."""
    room = max(1, usable(m.ram))
    return max(1, -(-(int(m.weights.value) + m.report.kv_bytes) // room))


def memory_ceiling(m: Measured) -> Ceiling:
    gb = m.token_bytes.value / 1e9
    return Ceiling(
        m.memory_gbs.value / gb,
        "memory",
        f"{m.memory_gbs.value:.1f} GB/s (memory probe) / {gb:.3f} GB a token",
    )


def one_machine(m: Measured) -> Ceiling:
    """The ceiling on this machine: resident when everything fits, else streamed."""
    resident = memory_ceiling(m)
    if per_host_need(m, 1) <= usable(m.ram) or m.disk_gbs is None or not m.routed:
        return resident
    room = usable(m.ram) - m.dense.value - m.report.kv_bytes
    if room <= 0:
        return Ceiling(
            0.0,
            "RAM",
            f"the dense part and the KV cache ({(m.dense.value + m.report.kv_bytes) / GiB:.2f}"
            f" GiB) do not fit the RAM budget less its reserve ({usable(m.ram) / GiB:.2f} GiB)",
        )
    cached = min(1.0, room / m.routed)
    miss_gb = (1.0 - cached) * m.cold_bytes.value / 1e9
    if miss_gb <= 0:
        return resident
    disk = m.disk_gbs.value / miss_gb
    if disk >= resident.tok_s:
        return resident
    return Ceiling(
        disk,
        "disk",
        f"{m.disk_gbs.value:.2f} GB/s (disk probe) / {miss_gb:.3f} GB of experts a token "
        f"from disk: the RAM left after the dense part and the KV cache "
        f"({room / GiB:.1f} GiB) caches {cached:.0%} of the "
        f"{m.routed / GiB:.1f} GiB of experts, every expert taken as equally likely",
    )


def cluster(m: Measured, hosts: int) -> tuple[Ceiling | None, str]:
    """The ceiling of one stream on ``hosts`` hosts like this one (None when they cannot
    hold the model), and the line that says why."""
    need, room = per_host_need(m, hosts), usable(m.ram)
    share = f"each host keeps {need / GiB:.2f} GiB of weights and KV of its {room / GiB:.2f} GiB"
    if need > room:
        least = hosts_needed(m)
        return None, f"{share}: {hosts} hosts are not enough, {least} like this one are"
    return memory_ceiling(m), f"{share}: every weight stays in RAM"
