"""Prometheus metrics (prometheus-client) of the pool's servers and of its controller.

Each process serves its own registry over HTTP (`serve`). What a server reports comes from
its latest poll of the admin API (server_actor.py), read at scrape time by a collector, so
nothing is counted twice; the controller adds histograms of what it times itself:
placements, handoffs and the downtime of contexts that a lost node took down.
"""
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import start_http_server

FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
SLOW = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def serve(registry, host="127.0.0.1", port=0):
    """Serve registry at http://host:port/metrics; returns the port bound (0: any free one)."""
    httpd, _ = start_http_server(port, addr=host, registry=registry)
    return httpd.server_port


class ServerCollector:
    """A server's figures, from snapshot() (server_actor.py PhosServer.snapshot) at scrape time."""

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot()
        labels = ["server", "node"]
        values = [s["address"], s["node_id"]]

        def gauge(name, doc, value):
            m = GaugeMetricFamily(name, doc, labels=labels)
            m.add_metric(values, value)
            return m

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc, labels=labels)
            m.add_metric(values, value)
            return m
        yield gauge("phos_server_up", "1 while the server answers its admin API", 1.0 if s["state"] == "up" else 0.0)
        yield gauge("phos_server_contexts", "contexts the server holds", len(s["contexts"]))
        yield gauge("phos_server_device_bytes_used", "device memory allocated by its contexts", s["bytes"])
        yield gauge("phos_server_device_bytes_total", "the device's memory", s["total"])
        yield gauge("phos_server_calls_per_second", "calls its contexts executed per second, between the last two polls",
                    s["calls_per_s"])
        yield counter("phos_server_calls", "calls its contexts executed (as polled)", s["calls_total"])
        yield counter("phos_server_checkpoints", "checkpoints completed through the admin API", s["checkpoints"])
        yield counter("phos_server_checkpoint_seconds", "the seconds those checkpoints took, summed (over "
                      "phos_server_checkpoints: their mean duration)", s["checkpoint_seconds"])
        yield counter("phos_server_restores", "contexts restored (recoveries, handoffs' targets, restores)", s["restores"])
        per = GaugeMetricFamily("phos_context_device_bytes", "device memory a context allocated",
                                labels=labels + ["ctx"])
        for c in s["contexts"]:
            per.add_metric(values + [str(c["id"])], c["bytes"])
        yield per


class ControllerMetrics:
    """The controller's registry: its view of the servers (a collector over view()) and the
    histograms of what it times."""

    def __init__(self, view):
        self.registry = CollectorRegistry()
        self.view = view
        self.registry.register(self)
        r = self.registry
        self.placement = Histogram("phos_pool_placement_seconds", "a context's creation through the pool, asked to "
                                   "answered (the chosen server's own time included)", buckets=FAST, registry=r)
        self.handoff = Histogram("phos_pool_handoff_seconds", "a drain's handoff of one context, whole", buckets=SLOW,
                                 registry=r)
        self.handoff_downtime = Histogram("phos_pool_handoff_downtime_seconds", "a handoff's frozen time: the "
                                          "application's calls were held", buckets=FAST, registry=r)
        self.recovery_downtime = Histogram("phos_pool_recovery_downtime_seconds", "from a lost server's contexts' first "
                                           "re-attach request to its answer from the server that restored it",
                                           buckets=SLOW, registry=r)
        self.drain = Histogram("phos_pool_drain_seconds", "a whole node's drain", buckets=SLOW, registry=r)

    def collect(self):
        servers = self.view()
        states = GaugeMetricFamily("phos_pool_servers", "servers by state", labels=["state"])
        for state in ("up", "draining", "drained", "lost"):
            states.add_metric([state], sum(1 for s in servers if s["state"] == state))
        yield states
        contexts = GaugeMetricFamily("phos_pool_contexts", "contexts on each server", labels=["server", "node"])
        free = GaugeMetricFamily("phos_pool_device_bytes_free", "free device memory of each server",
                                 labels=["server", "node"])
        for s in servers:
            contexts.add_metric([s["address"], s["node_id"]], s["contexts"])
            free.add_metric([s["address"], s["node_id"]], s["free"])
        yield contexts
        yield free

    def describe(self):       # the registry calls collect() at registration without it: it must not yet
        return []
