"""Prometheus metrics of the server, in a registry of their own (several servers in one process,
as in tests, do not collide). Names follow vLLM's where one exists, with the prefix `ling:`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
            5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_PER_TOKEN = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
              0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ling:request_success", "Requests finished, by finish reason (stop, length, abort)",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("ling:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("ling:generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("ling:time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY,
                              registry=r)
        self.tpot = Histogram("ling:time_per_output_token_seconds",
                              "Per request: (last token - first token) / (tokens - 1)", buckets=_PER_TOKEN, registry=r)
        self.itl = Histogram("ling:inter_token_latency_seconds", "Between a request's successive token deliveries "
                             "(a speculative step delivers several tokens at once)", buckets=_PER_TOKEN, registry=r)
        self.e2e = Histogram("ling:e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY, registry=r)
        self.waiting = Gauge("ling:num_requests_waiting", "Requests queued for a slot (queue depth)", registry=r)
        self.running = Gauge("ling:num_requests_running", "Requests holding a slot (running batch)", registry=r)
        # Mean accepted length = tokens / steps over the decode (verify) steps of live requests;
        # the counters let a client compute it over its own window.
        self.spec_steps = Counter("ling:spec_decode_steps", "Decode/verify steps, summed over live requests",
                                  registry=r)
        self.spec_tokens = Counter("ling:spec_decode_tokens", "Tokens those steps produced", registry=r)
        self.accept_length = Gauge("ling:spec_accept_length", "Mean accepted length since start (tokens per step)",
                                   registry=r)
        # Prefix cache (serve.prefix_cache): prompt tokens looked up and found, as vLLM's
        # prefix_cache_queries / prefix_cache_hits; the hit rate since start; pool entries.
        self.prefix_queries = Counter("ling:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("ling:prefix_cache_hits", "Prompt tokens restored from the prefix cache "
                                   "(not prefilled)", registry=r)
        self.prefix_hit_rate = Gauge("ling:prefix_cache_hit_rate", "Hit tokens / queried tokens since start",
                                     registry=r)
        self.prefix_used = Gauge("ling:prefix_cache_entries_used", "Prefix-cache pool entries holding a checkpoint",
                                 registry=r)
        self.prefix_entries = Gauge("ling:prefix_cache_entries_total", "Prefix-cache pool entries (0: cache off)",
                                    registry=r)
        self._queried = self._hit = 0
        self._steps = self._tokens = 0
        Gauge("ling:model_info", "The served model", ["model_name"], registry=r).labels(model_name).set(1)

    def record_steps(self, steps: int, tokens: int) -> None:
        if steps:
            self.spec_steps.inc(steps)
            self.spec_tokens.inc(tokens)
            self._steps, self._tokens = self._steps + steps, self._tokens + tokens
            self.accept_length.set(self._tokens / self._steps)

    def record_prefix(self, lookups, used: int) -> None:
        """lookups: (prompt tokens, hit tokens) of each request admitted; used: pool entries in use."""
        queried, hit = sum(q for q, _ in lookups), sum(h for _, h in lookups)
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hit)
        self._queried, self._hit = self._queried + queried, self._hit + hit
        if self._queried:
            self.prefix_hit_rate.set(self._hit / self._queried)
        self.prefix_used.set(used)

    def render(self) -> bytes:
        return generate_latest(self.registry)
