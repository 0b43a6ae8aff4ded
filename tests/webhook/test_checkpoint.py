"""checkpoint_drain: the node's jobs are asked to checkpoint, and the drain waits for them up to a grace."""

from __future__ import annotations

import pytest
from gpuhealth.webhook.backends.base import BackendError
from gpuhealth.webhook.config import ConfigError, parse_config
from waiting import eventually
from webhook_helpers import alert

PREDICTIVE = {"action": "checkpoint_drain", "alertname": "GPUHealthGpuFailureRisk", "severity": "warning"}


def ops(hook) -> list[str]:
    return [entry[0] for entry in hook.backend.history]


async def signalled(hook, count: int) -> None:
    async def probe() -> list[str]:
        return ops(hook)
    await eventually(probe, lambda seen: seen.count("signal") == count, timeout=20, what="the jobs signalled")


async def test_the_drain_waits_for_the_jobs_checkpoint_comment(webhook):
    hook = await webhook(jobs={"gpu01": ["7", "8"]},
                         checkpoint={"confirm": "comment", "grace_seconds": 60, "poll_seconds": 0.05})
    await hook.post(alert("gpu01", **PREDICTIVE))
    await signalled(hook, 2)
    assert ("signal", "7", "USR1", "batch") in map(tuple, hook.backend.history)
    hook.backend.set_comment("7", "checkpoint at step 400")
    hook.backend.set_comment("8", "checkpointed")
    [action] = await hook.until(lambda acts: acts[0]["state"] == "done", "the drain to end")
    assert ops(hook) == ["signal", "signal", "drain", "requeue", "requeue"], "checkpoint first, then drain"
    assert action["progress"]["checkpoint"]["confirmed"] == ["7", "8"]
    assert "checkpoint confirmed by jobs 7,8" in action["detail"]


async def test_the_drain_goes_ahead_after_the_grace_without_a_confirmation(webhook):
    hook = await webhook(jobs={"gpu02": ["9"]}, checkpoint={"grace_seconds": 0.3, "poll_seconds": 0.05,
                                                            "signal": "SIGUSR2", "target": "full"})
    await hook.post(alert("gpu02", **PREDICTIVE))
    [action] = await hook.until(lambda acts: acts[0]["state"] == "done", "the drain to end")
    assert hook.backend.history[0] == ["signal", "9", "SIGUSR2", "full"]
    assert ops(hook) == ["signal", "drain", "requeue"]
    assert action["progress"]["checkpoint"]["unconfirmed"] == ["9"]
    assert "no checkpoint confirmed by jobs 9" in action["detail"]


async def test_a_job_that_ended_confirms_and_is_still_requeued(webhook):
    hook = await webhook(jobs={"gpu03": ["5"]}, checkpoint={"grace_seconds": 60, "poll_seconds": 0.05})
    await hook.post(alert("gpu03", **PREDICTIVE))
    await signalled(hook, 1)
    hook.backend.state["jobs"]["5"]["node"] = None  # it saved and exited
    [action] = await hook.until(lambda acts: acts[0]["state"] == "done", "the drain to end")
    assert action["progress"]["checkpoint"]["confirmed"] == ["5"]
    assert action["progress"]["jobs"] == ["5"], "the job asked to checkpoint is requeued even if it ended"


async def test_a_hard_failure_drains_at_once_without_a_signal(webhook):
    hook = await webhook(jobs={"gpu04": ["3"]}, checkpoint={"grace_seconds": 600})
    await hook.post(alert("gpu04", action="drain"))
    await hook.until(lambda acts: acts[0]["state"] == "done", "the drain to end")
    assert ops(hook) == ["drain", "requeue"]


async def test_a_predictive_alert_whose_repair_is_a_reset_checkpoints_before_the_drain(webhook):
    hook = await webhook(jobs={"gpu06": ["11"]},
                         checkpoint={"confirm": "comment", "grace_seconds": 60, "poll_seconds": 0.05})
    await hook.post(alert("gpu06", gpu="5", action="checkpoint_drain_reset_gpu", severity="warning",
                          alertname="GPUHealthEccCorrectedStorm"))
    await signalled(hook, 1)
    assert "drain" not in ops(hook), "nothing stops the job before its checkpoint"
    hook.backend.set_comment("11", "checkpointed")
    [action] = await hook.until(lambda acts: acts[0]["state"] == "done", "the reset to end")
    assert ops(hook) == ["signal", "drain", "requeue", "reset_gpu"]
    assert hook.backend.history[-1][:3] == ["reset_gpu", "gpu06", "5"]
    assert action["progress"]["checkpoint"]["confirmed"] == ["11"]


async def test_a_hard_failure_after_a_predictive_reset_is_not_held_back_by_the_cooldown(webhook):
    hook = await webhook(guardrails={"node_cooldown_seconds": 3600}, checkpoint={"grace_seconds": 0.1})
    await hook.post(alert("gpu07", gpu="1", action="checkpoint_drain_reset_gpu", severity="warning",
                          alertname="GPUHealthEccCorrectedStorm"))
    await hook.until(lambda acts: acts[0]["state"] == "done", "the predictive reset to end")
    await hook.post(alert("gpu07", gpu="1", action="drain_reset_gpu", alertname="GPUHealthXidResetGpu"))
    actions = await hook.until(lambda acts: len(acts) == 2 and acts[-1]["state"] == "done",
                               "the hard failure's reset, not held back")
    assert (actions[-1]["kind"], actions[-1]["reason"]) == ("drain_reset_gpu", "ok"), actions[-1]


async def test_a_job_that_cannot_be_signalled_is_not_waited_for(webhook):
    hook = await webhook(jobs={"gpu05": ["4"]}, checkpoint={"grace_seconds": 600})
    hook.backend.state["jobs"]["ghost"] = {"node": "gpu05", "requeues": 0, "excluded": []}

    async def refuse(job_id: str, signal: str, target: str) -> None:
        raise BackendError(f"job {job_id}: signals refused", retryable=False)

    hook.backend.signal_job = refuse
    await hook.post(alert("gpu05", **PREDICTIVE))
    [action] = await hook.until(lambda acts: acts[0]["state"] == "done", "the drain to end", timeout=20)
    assert set(action["progress"]["checkpoint"]["errors"]) == {"4", "ghost"}
    assert ops(hook) == ["drain", "requeue", "requeue"]


def test_checkpoint_settings_are_checked_together():
    with pytest.raises(ConfigError) as err:
        parse_config({"backend": {"type": "simulated", "nodes": ["a"]},
                      "checkpoint": {"confirm": "file", "signal": "USR1; reboot", "target": "all"}})
    text = str(err.value)
    assert "checkpoint.path: required with confirm: file" in text
    assert "checkpoint.signal" in text and "checkpoint.target" in text
    with pytest.raises(ConfigError, match=r"the only placeholder is \{job_id\}"):
        parse_config({"backend": {"type": "simulated", "nodes": ["a"]},
                      "checkpoint": {"confirm": "file", "path": "/ckpt/{node}"}})


async def test_a_hard_fault_after_a_predictive_drain_still_resets_the_gpu(webhook):
    """The predictive drain is the weaker action: its cooldown never holds back the stronger one."""
    hook = await webhook(jobs={"gpu06": ["21"]}, guardrails={"node_cooldown_seconds": 3600},
                         checkpoint={"grace_seconds": 0})
    await hook.post(alert("gpu06", **PREDICTIVE))
    await hook.until(lambda acts: acts[0]["state"] == "done", "the predictive drain to end")
    await hook.post(alert("gpu06", action="drain_reset_gpu", alertname="GPUHealthXidResetGpu", gpu="3"))
    actions = await hook.until(lambda acts: len(acts) == 2 and acts[1]["state"] == "done", "the reset")
    assert actions[1]["reason"] == "ok", actions[1]
    assert [entry[:3] for entry in hook.backend.history if entry[0] == "reset_gpu"] == [["reset_gpu", "gpu06",
                                                                                        "3"]]
