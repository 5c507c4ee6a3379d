"""The step loop every rank runs: rank 0 decides (server/scheduler.py), all apply.

Rank 0 sends each step's `Decision` to every rank with one exchange; then every rank
applies it and steps its engine. With nothing to do, rank 0 waits on its scheduler's
condition variable for up to `IDLE_TICK` and then sends an idle decision; the other
ranks sleep for that long before they wait for the next one. MLX's ring backend spins
while a rank waits in a collective, so ranks that waited in the broadcast all the time
would burn a core each on an idle server; this way they are in it only for the last few
milliseconds of each tick, and a new request waits at most one tick. Idle waits are
outside any watchdog stage, so an idle server can stay idle forever while a stalled
step still ends every rank; a rank that dies while idle shows at the next tick.

With `--dp D` replicas every replica applies its own decision and steps its own batch
at the same time, and one `all_gather_object` over the world brings the replicas'
events back to rank 0 (each replica's first rank sends them; the others send nothing).
The replicas step in lockstep: a step takes as long as the slowest replica's. A replica
with no sequence sleeps through most of the others' step (REST_SHARE of the longest
decode-only step the replicas reported in the last exchange) before it joins the
exchange, rather than spin in it.

About once a second rank 0 marks a decision (an idle one too) `report`: after the
broadcast every rank sends rank 0 its memory and step time in one `all_gather_object`
(server/status.py), all of them because all received the same decision.

The broadcast is an all-gather in which rank 0 sends the decision and each other rank
the requests whose grammars it has compiled (`exchange`: the scheduler's `prepared`).

A request's own failure in the step loop (its logits processors, its text) ends that
request with an error event (engine/sequence.py), never the loop; only a fault of the
model or the cluster does.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import mlx.core as mx
from mlx_lm.generate import wired_limit

from ..cluster import watchdog
from ..cluster.distributed import all_gather_object, first_line
from ..engine.batch import BatchEngine, Decision
from ..engine.grammar import Prefetch
from .scheduler import Scheduler
from .status import StepClock, gather_reports

IDLE_MARGIN = 0.01  # the other ranks wake this much earlier than rank 0 sends
REST_SHARE = 0.8  # of the others' last decode step, a replica with nothing to do sleeps


def run_steps(
    engine: BatchEngine,
    scheduler: Scheduler | None,
    group: mx.distributed.Group,
    mesh=None,
) -> None:
    """The step loop: rank 0 (with `scheduler`) decides, every rank applies and decodes.
    About once a second every rank reports its memory and step time to rank 0's
    `scheduler.monitor` (server/status.py), when it has one.

    `group`: the world. `mesh` (parallel.mesh.Mesh): with `mesh.dp` > 1 this rank's
    engine is replica `mesh.replica` (see the module's docstring).
    Returns after a stop decision. On rank 0 an exception (a lost peer) first answers
    every open request with a 503 error, so that no client is left waiting.
    """
    rank0 = group.rank() == 0
    dp = mesh.dp if mesh is not None else 1
    try:
        with wired_limit(engine.model):  # Metal: keep the weights resident (CPU: nothing)
            _step_loop(engine, scheduler, group, mesh, rank0, dp)
    except BaseException as e:
        if rank0 and scheduler is not None:
            scheduler.fail_all(_failure_message(e))
            time.sleep(0.5)  # let the HTTP thread send the errors before the process ends
        raise


def _step_loop(engine, scheduler, group, mesh, rank0: bool, dp: int) -> None:
    """run_steps' loop, until a stop decision."""
    rest = 0.0  # seconds the replicas' last decode-only step took (the longest)
    clock = StepClock()
    last_end = None  # when the last generation step ended (None: idle since)
    monitor = scheduler.monitor if rank0 else None
    prefetch = None if rank0 else Prefetch(engine.tokenizer, engine.shard.size, engine.eos)
    awaited: list[int] = []  # requests rank 0 waits for this rank's grammars of
    while True:
        decisions = None
        if rank0:
            active = [len(engine)] if dp == 1 else scheduler.rows()
            tick = scheduler.tick()
            decisions = scheduler.next_decisions(active, wait=tick)
            if decisions is None:
                last_end = None  # idle: the next step starts a new chain
                if group.size() == 1:
                    if monitor is not None and monitor.due():
                        monitor.update(gather_reports(group, mesh, clock))
                    continue
                decisions = [Decision(idle=tick)]  # keeps the others sleeping
            decisions[0].report = monitor is not None and monitor.due()
            if group.size() > 1:
                scheduler.announce(decisions[0])
        # The one exchange per step besides the model's own, and the reports' gather.
        # Unarmed on the other ranks (rank 0 may still be deciding, or idle); armed on
        # rank 0 once it has decided on a step, so that a stopped peer there is a
        # stalled step like any other rather than an idle silence.
        busy = rank0 and not (decisions[0].idle or decisions[0].stop)
        with (
            watchdog.stage(f"generation step ({len(engine)} sequences)") if busy else nullcontext()
        ):
            if group.size() > 1:
                decisions, ready = exchange(
                    decisions, prefetch.ready(awaited) if prefetch else [], group
                )
                if rank0:
                    scheduler.prepared(ready)
                else:
                    prefetch.want(decisions[0].prepare)
                    awaited = decisions[0].awaited
            if decisions[0].report:  # every rank got the same decision: all gather
                reports = gather_reports(group, mesh, clock)
                if monitor is not None:
                    monitor.update(reports)
        if decisions[0].idle or not len(engine):
            last_end = None  # the next step starts a new chain
        if decisions[0].idle:
            if not rank0:  # rank 0 waits on its queue instead
                time.sleep(max(0.0, decisions[0].idle - IDLE_MARGIN))
            continue
        if decisions[0].stop:
            if rank0:
                scheduler.fail_all("the server is shutting down")
            return
        decision = decisions[mesh.replica if dp > 1 else 0]
        events = []
        # a long prompt's next chunk (`filling`); embedding requests to queue
        if decision.joins or decision.embeds or decision.cancels or engine.filling:
            n = sum(len(j.prompt) for j in decision.joins)
            n += sum(len(s.tokens) - s.fed for s, _ in engine.filling)
            with watchdog.stage(f"prompt processing ({n} tokens)", "load"):
                events = engine.apply(decision)
        batch = len(engine) if dp == 1 or not rank0 else sum(scheduler.rows())
        with watchdog.stage(f"generation step ({len(engine)} sequences)"):
            resting = dp > 1 and not engine.busy  # other replicas are stepping
            tic = time.perf_counter()
            if not resting:
                events += engine.step()
                # A step's computation runs asynchronously, overlapping the loop's other
                # work (the decision's broadcast, dispatching events), so the step is timed
                # from the previous step's end when the loop went straight on to this one
                # (no idle tick, no prompt between); otherwise from this step's start.
                end = time.perf_counter()
                chained = last_end is not None and not decision.joins
                clock.add(end - (last_end if chained else tic))
                last_end = end
            if dp > 1:  # each replica's first rank sends its events to rank 0
                # A decode-only step's time, for the replicas that rest next time.
                took = None if resting or decision.joins else time.perf_counter() - tic
                if resting:
                    # Off the CPU for most of the others' last decode step (the ring
                    # backend spins inside a collective), then join the exchange.
                    time.sleep(REST_SHARE * rest)
                sender = mesh.replica_group.rank() == 0
                gathered = all_gather_object((events, took) if sender else ([], None), group)
                events = [e for part, _ in gathered for e in part]
                steps = [t for _, t in gathered if t is not None]
                rest = max(steps) if steps else rest
        if rank0:
            if monitor is not None and batch:
                monitor.stepped(batch)
            scheduler.dispatch(events)


def exchange(
    decisions: list[Decision] | None, ready: list[int], group: mx.distributed.Group
) -> tuple[list[Decision], list[list[int]]]:
    """Rank 0's decisions on every rank, and on rank 0 what each other rank has compiled
    (`ready`: request ids); one all-gather, as a broadcast is."""
    got = all_gather_object(decisions if group.rank() == 0 else ready, group)
    return got[0], got[1:]


def _failure_message(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return "the server is shutting down"
    text = first_line(e)
    if "connection to a peer was lost" in text:
        return f"a rank of the server failed: {watchdog.PEER_LOST}"
    return f"the server failed: {text}"
