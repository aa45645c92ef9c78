"""``elasticzero.launch.supervise``: which endings are node losses, when a lost node is started again, the exit code."""

from __future__ import annotations

import pytest

from elasticzero.launch.supervise import JobView, Keep, Restart, describe, is_node_loss, job_exit, on_exit


def view(others: int = 1, result: bool = False, used: int = 0, budget: int = 3, mine: int = 0) -> JobView:
    return JobView(others_running=others, result_seen=result, restarts_used=used, budget=budget, node_restarts=mine)


LOST, RESULTS = [255, 137, 143, 129], [0, 1, 2, 7, 127, 128]


@pytest.mark.parametrize(("code", "lost"), [(c, True) for c in LOST] + [(c, False) for c in RESULTS])
def test_a_node_loss_is_ssh_255_or_the_agent_killed_by_a_signal(code: int, lost: bool) -> None:
    assert is_node_loss(code) is lost


def test_describe_names_the_cause() -> None:
    assert describe(255) == "exit 255: the ssh connection failed or died"
    assert describe(137) == "exit 137: the agent was killed by SIGKILL"
    assert describe(3) == "exit 3"


def test_a_lost_node_is_restarted_with_a_doubling_backoff_and_the_budget_is_the_jobs() -> None:
    first = on_exit("node2", 137, view())
    assert isinstance(first, Restart) and first.delay_s == 1.0
    assert first.line == (
        "node2's agent ended (exit 137: the agent was killed by SIGKILL); starting it again in 1 s "
        "(node restart 1 of 3)"
    )
    third = on_exit("node2", 255, view(used=2, mine=2))
    assert isinstance(third, Restart) and third.delay_s == 4.0 and "(node restart 3 of 3)" in third.line
    assert on_exit("node2", 255, view(used=0, mine=9)).delay_s == 30.0  # type: ignore[union-attr]  # capped


def test_no_restart_past_the_budget_or_once_the_job_is_over() -> None:
    spent = on_exit("node2", 255, view(used=3))
    assert isinstance(spent, Keep) and "no node restarts left (--max-node-restarts 3)" in spent.line
    over = on_exit("node2", 137, view(result=True))
    assert isinstance(over, Keep) and "the job is over on the other nodes" in over.line
    alone = on_exit("node2", 137, view(others=0))  # nothing left to rejoin
    assert isinstance(alone, Keep) and "not restarted" in alone.line
    assert on_exit("node2", 137, view(budget=0)) == Keep(
        "node2's agent ended (exit 137: the agent was killed by SIGKILL); no node restarts left "
        "(--max-node-restarts 0): the job goes on without it"
    )


@pytest.mark.parametrize("code", [0, 1, 3])
def test_the_jobs_result_is_never_restarted(code: int) -> None:
    assert on_exit("node2", code, view()) == Keep("")


@pytest.mark.parametrize(
    ("codes", "want"),
    [
        ([0, 0], 0),
        ([255, 0], 0),  # a node lost for good while the others finished the job
        ([137, 3, 0], 3),  # the job's failure wins over a loss and a finish
        ([0, 5, 3], 5),  # the first failure
        ([255, 137], 255),  # every node lost: the first loss
        ([], 0),
    ],
)
def test_the_launch_exit_code(codes: list[int], want: int) -> None:
    assert job_exit(codes) == want
