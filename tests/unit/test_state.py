import pytest
from expecttest import assert_expected_inline

from shardkit.state import TRANSITIONS, IllegalTransition, Phase, PhaseEvent, PhaseMachine, render_transitions


def test_transition_table_is_pinned():
    assert_expected_inline(render_transitions(), """\
IDLE          --pre_forward--> FORWARD
FORWARD       --post_forward--> IDLE
IDLE          --pre_backward--> PRE_BACKWARD
PRE_BACKWARD  --post_backward--> POST_BACKWARD
POST_BACKWARD --pre_backward--> PRE_BACKWARD
IDLE          --post_backward--> POST_BACKWARD
POST_BACKWARD --post_backward--> POST_BACKWARD
PRE_BACKWARD  --pre_forward--> PRE_BACKWARD
PRE_BACKWARD  --post_forward--> PRE_BACKWARD
IDLE          --finalize--> IDLE
FORWARD       --finalize--> IDLE
PRE_BACKWARD  --finalize--> IDLE
POST_BACKWARD --finalize--> IDLE""")


def test_every_phase_returns_to_idle_on_finalize():
    for phase in Phase:
        assert TRANSITIONS[(phase, PhaseEvent.FINALIZE)] is Phase.IDLE


def test_normal_step_walks_the_table():
    machine = PhaseMachine("blocks.0")
    for event in (PhaseEvent.PRE_FORWARD, PhaseEvent.POST_FORWARD, PhaseEvent.PRE_BACKWARD, PhaseEvent.POST_BACKWARD, PhaseEvent.FINALIZE):
        machine.advance(event)
    assert machine.phase is Phase.IDLE


@pytest.mark.parametrize(
    "events",
    [
        (PhaseEvent.POST_FORWARD,),  # post-forward without a forward
        (PhaseEvent.PRE_FORWARD, PhaseEvent.PRE_BACKWARD),  # backward while forward runs
        (PhaseEvent.PRE_FORWARD, PhaseEvent.POST_BACKWARD),
    ],
)
def test_illegal_transition_raises_with_group_name(events):
    machine = PhaseMachine("blocks.3")
    with pytest.raises(IllegalTransition, match=r"blocks\.3.*reset_iter_state"):
        for event in events:
            machine.advance(event)
