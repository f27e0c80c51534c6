"""Scheduling through the real session, scheduler and engine host on the test engine:
fairness, the bounded queue, cancel/stop/disconnect freeing the engine within one token,
interleaved streams, conversation KV reuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from fake_engine import LineReader, open_daemon

pytestmark = pytest.mark.trio


def submit(rid: str, prompt: str = "a", **opts: object) -> bytes:
    words = " ".join(f"{k}={v}" for k, v in opts.items())
    return f"SUBMIT {rid} {len(prompt.encode())} {words}\n{prompt}\n".encode()


async def test_round_robin_across_clients(tmp_path: Path) -> None:
    async with open_daemon(tmp_path, max_active=1, layer_delay_s=0.01) as daemon:
        started: list[str] = []
        real_start = daemon.state.host.start
        daemon.state.host.start = lambda job: (
            started.append(job.request.id),  # type: ignore
            real_start(job),
        )
        a, b = await daemon.connect(), await daemon.connect()
        await a.send_all(
            submit("a1", max_tokens=3) + submit("a2", max_tokens=3) + submit("a3", max_tokens=3)
        )
        await trio.sleep(0.01)
        await b.send_all(submit("b1", max_tokens=3))
        ra, rb = LineReader(a), LineReader(b)
        for rid in ("a1", "a2", "a3"):
            await ra.until(f"DONE {rid}")
        await rb.until("DONE b1")
        assert started.index("b1") < started.index("a3")


async def test_full_queue_answers_busy(tmp_path: Path) -> None:
    async with open_daemon(tmp_path, max_queue=1, max_active=1, layer_delay_s=0.02) as daemon:
        conn = await daemon.connect()
        reader = LineReader(conn)
        await conn.send_all(submit("r1", max_tokens=5))
        await reader.until("ACCEPT r1")
        await conn.send_all(submit("r2", max_tokens=5) + submit("r3", max_tokens=5))
        assert (await reader.until("ERROR r3"))[-1].startswith("ERROR r3 BUSY")
        await reader.until("DONE r2")


async def test_cancel_during_prefill_frees_engine_within_a_layer(tmp_path: Path) -> None:
    async with open_daemon(tmp_path, layer_delay_s=0.2) as daemon:
        conn = await daemon.connect()
        reader = LineReader(conn)
        await conn.send_all(submit("p", "x" * 50, max_tokens=50))
        await reader.until("ACCEPT p")
        t0 = trio.current_time()
        await conn.send_all(b"CANCEL p\n")
        line = (await reader.until("ERROR p"))[-1]
        assert line.startswith("ERROR p CANCELLED cancelled after 0 generated")
        assert trio.current_time() - t0 < 0.39  # less than the prefill's two layers
        assert daemon.state.host.statistics().active == 0


async def test_cancel_and_stop_during_decode(tmp_path: Path) -> None:
    async with open_daemon(tmp_path, layer_delay_s=0.002) as daemon:
        conn = await daemon.connect()
        reader = LineReader(conn)
        await conn.send_all(submit("d", max_tokens=400))
        await reader.until("DATA d")
        await conn.send_all(b"CANCEL d\n")
        assert (await reader.until("ERROR d"))[-1].startswith("ERROR d CANCELLED")
        await conn.send_all(submit("s", max_tokens=400))
        await reader.until("DATA s")
        await conn.send_all(b"STOP s\n")
        done = (await reader.until("DONE s"))[-1]
        assert "finish=stopped" in done and " 400 " not in done
        await conn.send_all(submit("next", max_tokens=2))
        assert "finish=length" in (await reader.until("DONE next"))[-1]


async def test_dropped_connection_frees_engine(tmp_path: Path) -> None:
    async with open_daemon(tmp_path, max_active=1, layer_delay_s=0.002) as daemon:
        gone = await daemon.connect()
        await gone.send_all(submit("long", max_tokens=400))
        await LineReader(gone).until("DATA long")
        await gone.aclose()
        other = await daemon.connect()
        await other.send_all(submit("after", max_tokens=3))
        with trio.fail_after(2):
            await LineReader(other).until("DONE after")
        assert daemon.state.host.statistics().active == 0


async def test_two_clients_stream_interleaved(tmp_path: Path) -> None:
    async with open_daemon(tmp_path, layer_delay_s=0.003) as daemon:
        order: list[str] = []

        async def client(name: str) -> None:
            conn = await daemon.connect()
            reader = LineReader(conn)
            await conn.send_all(submit(name, max_tokens=30))
            while True:
                line = await reader.line()
                if line.startswith("DATA"):
                    order.append(name)
                if line.startswith("DONE"):
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(client, "A")
            nursery.start_soon(client, "B")
        assert order.count("A") == order.count("B") == 30
        first_done = min(len(order) - order[::-1].index(n) for n in "AB")
        assert set(order[:first_done]) == {"A", "B"}  # both streamed before either ended


async def test_duplicate_id_and_conversation_busy(tmp_path: Path) -> None:
    async with open_daemon(tmp_path, layer_delay_s=0.01) as daemon:
        conn = await daemon.connect()
        reader = LineReader(conn)
        await conn.send_all(submit("x", max_tokens=50, conv="c"))
        await reader.until("ACCEPT x")
        await conn.send_all(submit("x", max_tokens=1) + submit("y", max_tokens=1, conv="c"))
        lines = await reader.until("ERROR y")
        assert any(line.startswith("ERROR x DUPLICATE_ID") for line in lines)
        assert lines[-1].startswith("ERROR y CONV_BUSY")
        await conn.send_all(b"STOP x\n")
        await reader.until("DONE x")


async def test_conversation_reuses_kv(tmp_path: Path) -> None:
    async with open_daemon(tmp_path) as daemon:
        conn = await daemon.connect()
        reader = LineReader(conn)
        engine = daemon.state.engine
        await conn.send_all(submit("t1", "hello world", max_tokens=4, conv="k"))
        await reader.until("DONE t1")
        before = engine.computed
        await conn.send_all(submit("t2", "hello world" + "efgh" + " more", max_tokens=1, conv="k"))
        done = (await reader.until("DONE t2"))[-1]
        assert "cached=14" in done  # prompt + 3 of the 4 answer tokens were in the KV
        assert engine.computed - before == 20 - 14
