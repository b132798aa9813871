"""bench/concurrency.py's pure figures: what a batch of replies measures, the KV cache size it
compares the resident set with, and the ratio rows with their verdicts against issue 15's targets.
Runs no server (the script itself is run by hand: bench/README.md)."""


import pytest

from tests.support.bench import bench_module


@pytest.fixture(scope="module")
def concurrency():
    """bench/concurrency.py as a module (it imports bench/compare.py from beside itself)."""
    with bench_module("concurrency") as module:
        yield module


def reply(sent, first, end, tokens):
    return {"sent": sent, "first": first, "end": end, "tokens": tokens}


def figures(aggregate, ttft_p95=1.0):
    return {"aggregate": aggregate, "ttft_p50": ttft_p95 / 2, "ttft_p95": ttft_p95, "client_tps": aggregate,
            "tokens": 64}


class BatchFiguresTests:
    """batch_figures: aggregate over the whole batch's wall time, percentiles of time to first token."""

    def test_aggregate_spans_first_request_to_last_byte(self, concurrency):
        """All reply tokens over the time from the earliest request sent to the latest byte received."""
        got = concurrency.batch_figures([reply(10.0, 10.5, 12.0, 30), reply(10.2, 11.0, 14.0, 50)])
        assert got["tokens"] == 80
        assert got["wall"] == pytest.approx(4.0)
        assert got["aggregate"] == pytest.approx(20.0)

    def test_time_to_first_token_percentiles(self, concurrency):
        """p50 and p95 of five clients' waits 0.1..0.5 s, interpolated between ranks: 0.3 and 0.48 s."""
        replies = [reply(0.0, wait, 1.0, 2) for wait in (0.5, 0.1, 0.4, 0.2, 0.3)]
        got = concurrency.batch_figures(replies)
        assert got["ttft_p50"] == pytest.approx(0.3)
        assert got["ttft_p95"] == pytest.approx(0.4 + 0.8 * (0.5 - 0.4))

    def test_per_client_rate_counts_tokens_after_the_first(self, concurrency):
        """A client's rate is (tokens - 1) / (last byte - first token); one token alone gives 0; median over clients."""
        replies = [reply(0.0, 1.0, 2.0, 11), reply(0.0, 1.0, 3.0, 41), reply(0.0, 1.0, 1.0, 1)]
        assert concurrency.batch_figures(replies)["client_tps"] == pytest.approx(10.0)


class KVCacheTests:
    """The KV cache the resident set is compared with."""

    SMOLLM2 = {"n_layers": 30, "n_kv_heads": 3, "head_dim": 64}

    def test_stated_by_the_banner(self, concurrency):
        """A banner saying `KV cache P x S MiB` gives P slots of S MiB."""
        banner = "# krafla 0.7.0, isa avx2: model m, context 1024 of 8192, chat smollm, threads 2, kv f32, " \
                 "parallel 4 (KV cache 4 x 45.0 MiB)"
        assert concurrency.kv_from_banner(banner, self.SMOLLM2) == (4, 4 * 45 * 2**20, "banner")

    def test_computed_from_the_shape(self, concurrency):
        """Without it, one slot: keys and values of every layer, position and KV head, in the banner's KV type."""
        banner = "# krafla 0.7.0, isa avx2: model m, context 1024 of 8192, chat smollm, threads 2, kv {}"
        values = 2 * 30 * 1024 * 3 * 64
        assert concurrency.kv_from_banner(banner.format("f32"), self.SMOLLM2) == (1, values * 4, "computed")
        assert concurrency.kv_from_banner(banner.format("q8_0"), self.SMOLLM2)[1] == values / 32 * 34

    def test_a_banner_without_context_is_an_error(self, concurrency):
        """A banner naming neither context nor kv type is refused with the banner in the message."""
        with pytest.raises(ValueError, match="no context"):
            concurrency.kv_from_banner("# krafla 9", self.SMOLLM2)


class RowsTests:
    """The table rows: medians, ratios within rounds, and the verdicts against the targets."""

    def test_verdict(self, concurrency):
        """A minimum is met at or above it, a maximum at or below it; no target, no verdict."""
        assert concurrency.verdict(1.5, 1.5) == "met" and concurrency.verdict(1.49, 1.5) == "NOT met"
        assert concurrency.verdict(0.2, 0.2, at_most=True) == "met"
        assert concurrency.verdict(0.21, 0.2, at_most=True) == "NOT met"
        assert concurrency.verdict(3.0, None) == ""

    def test_ratio_is_the_median_of_the_rounds_ratios(self, concurrency):
        """Rounds 200/100, 100/100, 300/100: the ratio is 2.0 (median of 2, 1, 3), and the aggregate
        target applies from 4 clients on, not at 2."""
        rounds = [(figures(200, 0.5), figures(100, 1.0)), (figures(100, 0.5), figures(100, 0.4)),
                  (figures(300, 0.5), figures(100, 1.0))]
        rows = concurrency.concurrency_rows({("m", 2): rounds, ("m", 4): rounds})
        two, four = rows
        assert (two["aggregate_krafla"], two["aggregate_llama"], two["aggregate_ratio"]) == (200, 100, 2.0)
        assert two["aggregate_target"] is None and two["aggregate_met"] == ""
        assert four["aggregate_target"] == 1.5 and four["aggregate_met"] == "met"
        assert (four["ttft_p95_krafla"], four["ttft_p95_llama"], four["ttft_p95_met"]) == (0.5, 1.0, "met")

    def test_one_client_ratio_is_parallel_n_over_parallel_1(self, concurrency):
        """The one-client row divides --parallel N's rate by --parallel 1's: 96 / 100 misses 0.97."""
        rows = concurrency.single_rows({"m": [(figures(100), figures(96))]}, 8)
        assert rows[0]["aggregate_parallel_1"] == 100 and rows[0]["aggregate_parallel_n"] == 96
        assert rows[0]["ratio"] == pytest.approx(0.96) and rows[0]["met"] == "NOT met"

    def test_one_client_ratio_is_the_median_of_the_pairs(self, concurrency):
        """Each pair is divided on its own: the host's speed in one pair does not leak into another.
        Pairs at 100/96, 50/50 and 200/210 give ratios 0.96, 1.0 and 1.05, median 1.0; the medians
        of the rates alone (100 and 96) would say 0.96."""
        pairs = [(figures(100), figures(96)), (figures(50), figures(50)), (figures(200), figures(210))]
        row = concurrency.single_rows({"m": pairs}, 8)[0]
        assert row["ratio"] == pytest.approx(1.0) and row["met"] == "met" and row["pairs"] == 3
        assert row["ratio_q1"] == pytest.approx(0.98) and row["ratio_q3"] == pytest.approx(1.025)

    def test_memory_row(self, concurrency):
        """Resident set over weights plus all slots' KV: 110 MiB over 80 + 20 is 1.10, which meets 1.10."""
        krafla = dict(figures(100), rss=110 * 2**20, weights=80 * 2**20, kv=20 * 2**20, kv_from="banner", slots=4)
        rows = concurrency.memory_rows({("m", 4): [(krafla, dict(figures(100), rss=90 * 2**20))]})
        assert rows[0]["rss_ratio"] == pytest.approx(1.10) and rows[0]["rss_met"] == "met"
        assert rows[0]["slots"] == 4 and rows[0]["rss_llama"] == 90 * 2**20

    def test_table_lines_match_their_heads(self, concurrency):
        """Every printed line has one cell per column, and the verdict shows beside its target."""
        rounds = [(figures(150), figures(100))]
        head, lines = concurrency.concurrency_lines(concurrency.concurrency_rows({("m", 8): rounds}))
        assert len(lines) == 1 and len(lines[0]) == len(head)
        assert lines[0][head.index("target")] == ">= 1.5x met"
