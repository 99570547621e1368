"""LoRA adapters in the scheduler: a step serves at most max_loras of them, requests name only
served ones, each reaches the executor with its adapter, and the prefix cache keeps an adapter's
blocks apart from the base model's."""
import pytest

from pagedserve.scheduler_svc.request import lora_adapters
from tests.scheduler_svc.helpers import add, make_scheduler, step


def test_a_step_serves_at_most_max_loras_adapters():
    s = make_scheduler(lora_names=("sql", "chat"), max_loras=1)
    add(s, 1, 4, lora_name="sql")
    add(s, 2, 4, lora_name="chat")
    add(s, 3, 4)
    plan, _ = step(s)
    # "chat" finds no slot while "sql" runs, and the base request behind it waits in arrival order.
    assert [(r.seq_id, r.lora_name) for r in plan.new_requests] == [(1, "sql")]
    add(s, 4, 4, lora_name="sql", first_token=50)
    s.abort("r1")
    plan, _ = step(s)
    # With "sql" gone, "chat" takes the slot; the new "sql" request waits for it again.
    assert [(r.seq_id, r.lora_name) for r in plan.new_requests] == [(2, "chat"), (3, "")]


def test_two_slots_take_two_adapters_and_the_base_model():
    s = make_scheduler(lora_names=("a", "b", "c"), max_loras=2)
    for seq_id, name in enumerate(["a", "b", "", "a", "c"], 1):
        add(s, seq_id, 4, first_token=10 * seq_id, lora_name=name)
    plan, _ = step(s)
    assert [r.lora_name for r in plan.new_requests] == ["a", "b", "", "a"]


def test_an_unknown_adapter_is_refused():
    s = make_scheduler(lora_names=("sql",), max_loras=1)
    with pytest.raises(ValueError, match="no LoRA adapter named 'chat' is served here; served: sql"):
        add(s, 1, 4, lora_name="chat")
    with pytest.raises(ValueError, match="--enable-lora"):
        add(make_scheduler(), 2, 4, lora_name="sql")


def test_the_prefix_cache_keeps_adapters_apart():
    s = make_scheduler(lora_names=("sql",), max_loras=1)
    base, adapted, again = add(s, 1, 8), add(s, 2, 8, lora_name="sql"), add(s, 3, 8, lora_name="sql")
    assert base.block_hashes != adapted.block_hashes and adapted.block_hashes == again.block_hashes


def test_the_running_and_waiting_adapters_that_metrics_name():
    s = make_scheduler(lora_names=("sql", "chat"), max_loras=1)
    for seq_id, name in enumerate(["sql", "", "chat", "sql"], 1):
        add(s, seq_id, 4, first_token=10 * seq_id, lora_name=name)
    step(s)
    assert (lora_adapters(s.running), lora_adapters(s.waiting)) == (["sql"], ["chat", "sql"])
