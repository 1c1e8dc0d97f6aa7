import pytest
from expecttest import assert_expected_inline

from shardkit.eager.schedule import Schedule
from shardkit.eager.state import RULES, Action, Event, IllegalTransition, Phase, render_rules, rule_for


def test_rules_table_is_pinned():
    assert_expected_inline(render_rules(), """\
| phase | event | next phase | actions, in order | when |
|---|---|---|---|---|
| IDLE | start_forward | FORWARD | open_pass, begin_calls, unshard, prefetch_forward, hook_inputs | the root's forward opens the pass |
| IDLE | pre_forward | FORWARD | begin_calls, unshard, prefetch_forward, hook_inputs | a group's forward starts |
| FORWARD | pre_forward | FORWARD | enter | re-entry: another module of the group, or a nested call |
| FORWARD | inner_post_forward | FORWARD | leave | that call ends; the group's forward goes on |
| FORWARD | post_forward | IDLE | leave, reshard_after_forward, hook_outputs | the group's forward ends |
| FORWARD | end_forward | IDLE | leave, reshard_after_forward, hook_outputs, close_pass | the root's forward ends: so does the pass |
| IDLE | recompute | FORWARD | begin_calls, unshard, hook_inputs | a group inside a recomputed one runs forward again |
| POST_BACKWARD | recompute | FORWARD | begin_calls, unshard, hook_inputs | ... for its other call, after this one's backward (two forwards, one backward) |
| FORWARD | recompute | FORWARD | enter | re-entry while it does |
| PRE_BACKWARD | recompute | PRE_BACKWARD | unshard | activation checkpointing recomputes the forward |
| PRE_BACKWARD | post_forward | PRE_BACKWARD | - | the recomputation ends: parameters stay for backward |
| IDLE | pre_backward | PRE_BACKWARD | queue_finalize, unshard_for_backward, prefetch_backward | a gradient reaches the group's outputs |
| PRE_BACKWARD | pre_backward | PRE_BACKWARD | - | another output of the same call |
| POST_BACKWARD | pre_backward | PRE_BACKWARD | queue_finalize, unshard_for_backward, prefetch_backward | a group called twice: its other call's outputs |
| PRE_BACKWARD | post_backward | POST_BACKWARD | reduce | the gradients reach the group's inputs |
| IDLE | post_backward | POST_BACKWARD | reduce | no gradient reached the outputs (or end of backward) |
| POST_BACKWARD | post_backward | POST_BACKWARD | reduce | a group called twice, both calls' gradients first |
| * | finalize | IDLE | end_step | the end of backward |
| * | reset | IDLE | drop_step | after an exception: reset_iter_state() |""")


@pytest.mark.parametrize("event", [Event.FINALIZE, Event.RESET])
def test_every_phase_returns_to_idle_on_finalize_and_reset(event):
    for phase in Phase:
        assert RULES[(phase, event)].next is Phase.IDLE


def test_every_action_is_a_schedule_method_and_every_action_is_used():
    for action in Action:
        assert callable(getattr(Schedule, action.value, None)), f"Schedule has no action {action.value}"
    used = {a for rule in RULES.values() for a in rule.actions}
    assert used == set(Action)


def test_a_normal_step_walks_the_table():
    phase = Phase.IDLE
    for event in (Event.PRE_FORWARD, Event.POST_FORWARD, Event.PRE_BACKWARD, Event.POST_BACKWARD, Event.FINALIZE):
        phase = rule_for(phase, event, "blocks.0").next
    assert phase is Phase.IDLE


@pytest.mark.parametrize(
    "events",
    [
        (Event.POST_FORWARD,),  # post-forward without a forward
        (Event.PRE_FORWARD, Event.PRE_BACKWARD),  # backward while forward runs
        (Event.PRE_FORWARD, Event.POST_BACKWARD),
        (Event.PRE_FORWARD, Event.POST_FORWARD, Event.PRE_BACKWARD, Event.POST_BACKWARD, Event.PRE_FORWARD),
    ],
)
def test_illegal_transition_raises_with_group_name(events):
    phase = Phase.IDLE
    with pytest.raises(IllegalTransition, match=r"blocks\.3.*reset_iter_state"):
        for event in events:
            phase = rule_for(phase, event, "blocks.3").next
