"""The supervisor's Prometheus metrics, appended to rank 0's at the front door's /metrics.

Read from the supervisor at each scrape (a collector of its own, nothing accumulates):

    llama_tp_supervisor_state{state}             1 for the current state, 0 for the others
    llama_tp_supervisor_restarts_total           generations started after the first
    llama_tp_supervisor_downtime_seconds_total   seconds not serving since the first start
    llama_tp_supervisor_hosts{kind="up"|"total"} hosts serving now, hosts named
    llama_tp_supervisor_waiting_requests         requests held for the next generation
    llama_tp_supervisor_last_fault_timestamp_seconds   when the last fault was detected
    llama_tp_supervisor_last_recovery_seconds{until}   from that fault to the relaunch,
                                                       to rank 0 ready, to the first answer
"""

from __future__ import annotations

STATES = ("starting", "serving", "degraded", "recovering", "restarting", "down", "failed",
          "stopping")  # fmt: skip


class _Collector:
    def __init__(self, sup):
        self.sup = sup

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.sup.status()
        state = GaugeMetricFamily(
            "llama_tp_supervisor_state", "the supervisor's state (1: current)", labels=["state"]
        )
        for name in STATES:
            state.add_metric([name], float(name == s["state"]))
        yield state
        yield CounterMetricFamily(
            "llama_tp_supervisor_restarts", "generations of ranks started after the first",
            value=s["restarts"],
        )  # fmt: skip
        yield CounterMetricFamily(
            "llama_tp_supervisor_downtime_seconds", "seconds not serving since the first start",
            value=s["downtime_seconds"],
        )  # fmt: skip
        hosts = GaugeMetricFamily("llama_tp_supervisor_hosts", "hosts", labels=["kind"])
        hosts.add_metric(["up"], s["hosts"]["up"])
        hosts.add_metric(["total"], s["hosts"]["total"])
        yield hosts
        yield GaugeMetricFamily(
            "llama_tp_supervisor_waiting_requests", "requests held for the next generation",
            value=s["waiting"],
        )  # fmt: skip
        fault = s["last_fault"]
        if fault is not None:
            yield GaugeMetricFamily(
                "llama_tp_supervisor_last_fault_timestamp_seconds",
                "when the last fault was detected (Unix time)",
                value=fault["at"],
            )
            took = GaugeMetricFamily(
                "llama_tp_supervisor_last_recovery_seconds",
                "from the last fault's detection to the relaunch, to rank 0 ready, to the "
                "first answer",
                labels=["until"],
            )
            for until in ("relaunch", "ready", "first_answer"):
                if (value := fault[f"seconds_to_{until}"]) is not None:
                    took.add_metric([until], value)
            yield took


def supervisor_metrics(sup) -> tuple[bytes, str]:
    """(Prometheus' text of `sup`'s metrics, its content type)."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(sup))
    return generate_latest(registry), CONTENT_TYPE_LATEST
