"""One reward call, made the same way on every path: training rollouts, evaluation, ``tpflow eval`` and
``inspect-trajectory``.

``call_reward`` runs the reward under a time limit, checks what it returned, repeats the call on an exception or on
non-finite scores, and otherwise stops with one paragraph (``RewardError``: exit status 2 from the CLI) naming the
reward and what went wrong, followed by the reward's last traceback frames when it raised:

- the output must be a ``RewardOutput`` (or any object with its two fields): ``scores`` a 1-D floating-point tensor
  with one value per image, ``details`` a dict of 1-D tensors of the same length. Anything else (a list, a 2-D
  tensor, the wrong length, integer scores) is a bug in the reward: it stops at once, without a retry;
- an exception is retried ``retries`` times on the same images (a flaky server or model), then stops; the
  RewardError is chained to the last exception (``__cause__``) and its message ends with the reward's own last
  frames, so a bug in a reward (a plugin's KeyError) is found from the message alone;
- out of GPU memory is not retried (the same images would run out again): it stops at once with
  ``RewardOutOfMemoryError``, naming the reward and how many images it was given, both a RewardError and torch's
  out-of-memory error, so the trainer's out-of-memory paragraph (``tpflow.train.out_of_memory``) reports it with
  the phase's setting, and any other command prints it as one paragraph;
- non-finite scores (NaN, ±inf) are retried likewise, then stop, or are kept (``nonfinite = "keep"``: the caller
  reports them; evaluation warns, see ``eval.nonfinite_rewards``);
- ``sys.exit`` inside a reward stops with a RewardError instead of ending the process silently; ``KeyboardInterrupt``
  propagates as usual;
- with ``timeout_s`` > 0 the reward runs in a daemon thread that the caller waits for at most that long. A call
  still running then is abandoned (Python cannot kill a thread): the caller gets a RewardError, any later call of the
  same reward object fails at once while it is still running, and the process can exit (daemon thread).
"""

from __future__ import annotations

import inspect
import threading
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from tpflow.devices import current_cuda_device
from tpflow.errors import RewardError, UserError
from tpflow.types import RewardOutput

if TYPE_CHECKING:
    from tpflow.settings import EvalSettings, TrainSettings

# Said of any reward call (training, evaluation, tpflow eval), which knows nothing of the run's checkpoints: it must
# not promise one that may not exist (a run stopped before its first save has none)
STOPPED = (
    "Stopped: fix the reward (or its server) and run again; a training run resumes with --resume from its last "
    "checkpoint, if it wrote one (a run stopped before its first checkpoint starts again from the beginning)."
)


@dataclass(frozen=True)
class RewardPolicy:
    """How a reward call may fail (recipe: ``train.reward_timeout_s``, ``train.reward_retries``,
    ``eval.nonfinite_rewards``)."""

    timeout_s: float = 600.0  # longest one call may run; 0: no limit (the call runs in the caller's thread)
    retries: int = 1  # repeats on the same images after an exception or non-finite scores
    nonfinite: Literal["stop", "keep"] = "stop"  # after the retries, or at once: return them to the caller
    quantise: bool = False  # images to the 8-bit grid first, as the remote reward sends them (equal scores)


DEFAULT_POLICY = RewardPolicy()

# torch.OutOfMemoryError (torch >= 2.5; torch.cuda's is the same class there) and torch.cuda.OutOfMemoryError before
OUT_OF_MEMORY = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError)


class RewardOutOfMemoryError(RewardError, torch.cuda.OutOfMemoryError):
    """A reward that ran out of GPU memory, not retried. Both kinds on purpose: as torch's out-of-memory error it
    reaches the trainer's out-of-memory paragraph, which names the phase's batch setting; as a RewardError any other
    command (``tpflow eval``, ``inspect-trajectory``) prints it as one paragraph, exit status 2."""


def recipe_policy(train: TrainSettings, evaluation: EvalSettings | None = None) -> RewardPolicy:
    """The policy a recipe sets for its training rollouts and inspect-trajectory (``evaluation`` None: non-finite
    scores stop), or for its evaluations (``eval.nonfinite_rewards = "warn"`` keeps them for the caller to report)."""
    keep = evaluation is not None and evaluation.nonfinite_rewards == "warn"
    return RewardPolicy(
        train.reward_timeout_s, train.reward_retries, "keep" if keep else "stop", train.quantise_reward_images
    )


_hung: dict[int, threading.Thread] = {}  # id(reward) -> its call that outlived the time limit (holds the reward)
_hung_lock = threading.Lock()


def call_reward(
    reward: Any,
    images: Tensor,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    policy: RewardPolicy = DEFAULT_POLICY,
) -> RewardOutput:
    """Score images [N, 3, H, W] under ``policy``; returns ``scores`` [N] float32 and ``details`` name -> [N] float32,
    both on the CPU. Raises RewardError (one paragraph naming the reward) when the reward cannot be used.

    With ``policy.quantise`` the reward gets float32 images on the 8-bit grid, round(x·255)/255: the pixels the remote
    reward's server decodes from its PNGs, so in-process and remote scores are equal for any reward."""
    n = images.shape[0]
    if policy.quantise:
        from tpflow.images import to_uint8

        images = to_uint8(images).to(torch.float32) / 255
    problem, cause = "", None
    for _attempt in range(policy.retries + 1):
        try:
            out = _timed_call(reward, images, prompts, metadata, policy.timeout_s)
        except UserError:  # a RewardError of its own (a remote server that stays down), a time limit, sys.exit
            raise
        except OUT_OF_MEMORY as exc:  # not retried: the same images would run out again
            raise RewardOutOfMemoryError(_out_of_memory(reward, n, exc)) from exc
        except Exception as exc:  # a flaky reward server or model: try again
            problem, cause = f"it raised {type(exc).__name__}: {one_line(str(exc))}", exc
            continue
        cause = None
        scores, details = check_output(out, n, reward)
        bad = int((~torch.isfinite(scores)).sum())
        if not bad or policy.nonfinite == "keep":
            return RewardOutput(scores=scores, details=details)
        problem = f"it returned {bad} non-finite score{'s' if bad > 1 else ''} (NaN or inf)"
    tries = {1: "once", 2: "twice"}.get(policy.retries + 1, f"{policy.retries + 1} times")
    message = f"Reward {reward_name(reward)} failed {tries} on the same {n} images ({problem}). {STOPPED}"
    if cause is None:
        raise RewardError(message)
    raise RewardError(f"{message}\n{_reward_frames(cause)}") from cause


def check_output(out: Any, n: int, reward: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """``scores`` [n] and ``details`` name -> [n] of a reward's output as float32 on the CPU; a RewardError naming
    ``reward`` (the reward, or a label) and what came back when it is not a RewardOutput of n images."""

    def wrong(what: str) -> RewardError:
        return RewardError(
            f"Reward {reward_name(reward)} returned {what} for {n} images. A reward returns "
            "tpflow.types.RewardOutput(scores=<float tensor [N]>, details={name: <tensor [N]>})."
        )

    scores = getattr(out, "scores", None)
    if not isinstance(out, RewardOutput) and not isinstance(scores, Tensor):
        raise wrong(f"{_describe(out)}, not a RewardOutput,")
    if not isinstance(scores, Tensor) or scores.dim() != 1 or scores.shape[0] != n:
        raise wrong(f"scores that are {_describe(scores)}")
    if not scores.is_floating_point():
        raise wrong(f"scores of dtype {scores.dtype} (cast them with .float())")
    details = getattr(out, "details", None)
    details = {} if details is None else details
    if not isinstance(details, Mapping):
        raise wrong(f"details that are {_describe(details)}, not a dict,")
    checked: dict[str, Tensor] = {}
    for key, value in details.items():
        if not isinstance(value, Tensor) or value.dim() != 1 or value.shape[0] != n or value.is_complex():
            raise wrong(f"details[{key!r}] that are {_describe(value)}")
        checked[str(key)] = value.detach().float().cpu()
    return scores.detach().float().cpu(), checked


def reward_name(reward: Any) -> str:
    """How messages name a reward: its registered name where it has one ("'pickscore' (PickScoreReward)"), else its
    class or function name. Called on the error path only (it may load the plugins' entry points)."""
    if isinstance(reward, str):
        return repr(reward)
    if inspect.isfunction(reward) or inspect.ismethod(reward):
        return repr(reward.__name__)
    kind = type(reward)
    try:
        from tpflow import registry

        registered = [e.name for e in registry.entries("reward") if e.factory is kind]
    except Exception:  # naming must never hide the error it is part of
        registered = []
    return f"{registered[0]!r} ({kind.__name__})" if registered else repr(kind.__name__)


def _timed_call(reward: Any, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict], timeout_s: float):
    """The reward's own output; a RewardError after ``timeout_s`` seconds (0: wait for ever) or on ``sys.exit``."""
    key = id(reward)
    with _hung_lock:
        stuck = _hung.get(key)
        if stuck is not None and stuck.is_alive():
            raise RewardError(
                f"Reward {reward_name(reward)} is still running a call that exceeded the time limit; it cannot be "
                f"called again in this process. {STOPPED}"
            )
        _hung.pop(key, None)
    if not timeout_s:
        return _guarded(reward, images, prompts, metadata)
    box: dict[str, Any] = {}
    grad, device = torch.is_grad_enabled(), current_cuda_device()  # thread-local: the worker starts from the caller's

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad):
                box["out"] = reward(images, prompts, metadata)
        except BaseException as exc:  # handed to the caller, SystemExit and KeyboardInterrupt included
            box["exc"] = exc

    thread = threading.Thread(target=run, name="tpflow-reward", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        with _hung_lock:
            _hung[key] = thread
        raise RewardError(
            f"Reward {reward_name(reward)} did not return within {timeout_s:g} s on {images.shape[0]} images "
            f"(train.reward_timeout_s): it hangs, or needs a longer limit. {STOPPED}"
        )
    if "exc" in box:
        exc = box.pop("exc")
        if isinstance(exc, SystemExit):
            raise _exited(reward, exc) from None
        raise exc
    return box["out"]


def _guarded(reward: Any, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> Any:
    try:
        return reward(images, prompts, metadata)
    except SystemExit as exc:
        raise _exited(reward, exc) from None


def _out_of_memory(reward: Any, n: int, exc: BaseException) -> str:
    """One line (the trainer's out-of-memory paragraph quotes an error's first line, in parentheses) naming the
    reward, its batch and the settings that size that batch, then torch's own words."""
    return (
        f"Reward {reward_name(reward)} ran out of GPU memory on a batch of {n} images, not retried as the same "
        "images would run out again; lower train.score_batch (training) or eval.batch_size (evaluation) to score "
        f"fewer at once: {one_line(str(exc)) or type(exc).__name__}"
    )


def _exited(reward: Any, exc: SystemExit) -> RewardError:
    return RewardError(
        f"Reward {reward_name(reward)} called sys.exit({exc.code!r}) while scoring: a reward must raise an exception "
        f"instead of ending the process. {STOPPED}"
    )


def _reward_frames(exc: BaseException, limit: int = 6) -> str:
    """The last ``limit`` frames of ``exc``'s traceback below this module (the reward's own, not the calls that led
    to it), in Python's format, then the exception's last line."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [i for i, frame in enumerate(frames) if frame.filename == __file__]
    own = frames[ours[-1] + 1 :] if ours else frames
    shown = traceback.StackSummary.from_list(own[-limit:])
    skipped = f" ({len(own) - limit} earlier frames not shown)" if len(own) > limit else ""
    lines = "".join(shown.format()) + "".join(traceback.format_exception_only(exc))
    return f"The reward's traceback, last frames{skipped}:\n{lines.rstrip()}"


def _describe(value: Any) -> str:
    """A few words on what a reward returned: 'a list of 4 float', 'a tensor of shape [4, 1] (torch.float32)'."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {list(value.shape)} ({value.dtype})"
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {len(value)} {'/'.join(kinds) or 'items'}"
    if value is None:
        return "None"
    return f"a {type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")


def one_line(text: str, limit: int = 300) -> str:
    """An exception's message as one line of at most ``limit`` characters (the error stays one paragraph)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
