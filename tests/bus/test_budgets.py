"""Per-client budgets of the request service: what one client, or many forged ones, may make it spend.

The buckets refill with time, so every check here asks for far more than a few milliseconds of
refill could add (budgets of a handful of requests per second, asked for within one call).
"""

from __future__ import annotations

from eventbus.bus.publish.budgets import Budget, ClientBudgets

SMALL = Budget(requests_per_second=5, bytes_per_second=1000, clients_in_total=2, max_clients=8)


def test_a_client_gets_its_budget_then_is_refused_and_silenced_while_another_is_served():
    budgets = ClientBudgets(SMALL)
    flooder, other = (b"flooder",), (b"other",)
    assert [budgets.take(flooder) for _ in range(5)] == [None] * 5
    refusal = budgets.take(flooder)
    assert refusal is not None and refusal[0] == "over budget" and "5 snapshot, replay and stats requests" in refusal[1]
    assert budgets.silenced(flooder) == "over budget"  # its next requests are refused before they are parsed
    assert budgets.take(other) is None and budgets.silenced(other) is None


def test_reply_bytes_are_charged_and_a_client_in_debt_waits():
    budgets = ClientBudgets(SMALL)
    client = (b"proxy", b"client")  # behind a proxy: the whole route is the client
    assert budgets.take(client) is None
    budgets.charge(client, 1500)  # one reply of 1.5 seconds' worth of bytes: granted, then paid off
    refusal = budgets.take(client)
    assert refusal is not None and refusal[0] == "over budget"
    assert budgets.take((b"proxy", b"another")) is None


def test_forged_identities_share_the_total_and_the_table_stays_bounded():
    budgets = ClientBudgets(SMALL)
    granted = sum(budgets.take((f"forged-{i}".encode(),)) is None for i in range(1000))
    assert granted == 10  # clients_in_total x requests_per_second, however many identities asked
    refusal = budgets.take((b"one-more",))
    assert refusal is not None and refusal[0] == "over total budget" and "asked again after" in refusal[1]
    # Told once, then refused unread until the total holds again: forged identities cost a lookup each.
    assert budgets.silenced((b"one-more",)) == "over total budget"
    # Until the total holds one request again (it is told so: its reply says when to ask again).
    assert 0 < budgets.silence_left((b"one-more",)) <= 1 / (SMALL.requests_per_second * SMALL.clients_in_total)
    assert len(budgets) == SMALL.max_clients


def test_a_client_that_does_not_read_is_silenced_longer_each_time_up_to_the_set_time():
    budgets = ClientBudgets(SMALL)
    silences = [budgets.silence((b"deaf",), "replies outstanding") for _ in range(10)]
    assert silences[0] == SMALL.first_silence and silences[-1] == SMALL.silence
    assert silences == sorted(silences) and silences[1] == 2 * silences[0]
    assert budgets.silenced((b"deaf",)) == "replies outstanding"
    assert budgets.silence((b"brief",), "replies outstanding", 0.0) == 0.0
    assert budgets.silenced((b"brief",)) is None


def test_a_pipelining_client_that_reads_its_replies_recovers_at_once():
    """Its queue full for a moment (a turn's replies faster than ZeroMQ reports them read), then a reply
    reaches it: its next full queue is a first, short silence again, never a growing one."""
    budgets = ClientBudgets(SMALL)
    reader = (b"reader",)
    for _ in range(20):
        assert budgets.silence(reader, "replies outstanding") == SMALL.first_silence
        budgets.replied(reader)
