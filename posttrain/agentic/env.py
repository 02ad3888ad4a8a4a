"""Environments for multi-turn episodes: the protocol, a tool-using environment, and an episode runner.

What it is:
- `Environment`: `reset(row) -> observation text` (the prompt) and
  `step(action text) -> (observation text or None, reward, done)`. An episode alternates the
  policy's actions and the environment's observations; the reward of the episode is the one
  `step` returns with done=True (intermediate rewards are 0 here, but the protocol allows any).
- `ToolEnv`: each action is parsed for a tool call (`parsing.parse_tool_call`, in the model
  family's format). A call runs the tool and its output, rendered with `render_tool_result`,
  is the next observation; a malformed call or an unknown tool gets an "Error: ..." observation
  (the model may retry); an action with no call is the final answer, and the episode is scored
  by `verifier(row, final action) -> float | bool`. After `max_turns` actions the episode ends
  whatever the last action was (a call then is not run; the verifier sees that action).
  `segments` is the episode as [(text, trainable)]: the prompt and the observations are not
  trainable (the policy did not write them), the actions are; `Episode` adds counts.
- `run_episode(env, policy, row)`: drive an episode with `policy(transcript) -> action` (a
  scripted policy in tests, or a per-episode wrapper around a sampler).
- `encode_segments(segments, encode)`: token ids and the loss mask (1 = trainable) of a segment list (from
  `data.formats`, where the SFT recipe's "segments" rows use it: an episode is SFT data as it is).
- `verify_answer(row, final action)`: the built-in verifier (`env.verifier: answer`): 1.0 when the final
  action's answer (`#### N`, else its last number) equals row["answer"].

What it is not: the batched rollout on the shared sampler (KV cache extended between turns,
tool-output tokens masked from the policy loss by position: that lives with the sampler and
GRPO); `encode_segments` re-tokenizes text, which is exact for the byte tokenizer but can differ
from sampled ids at segment boundaries under a BPE tokenizer, so a rollout should keep the ids it
sampled and only mark which spans came from the environment.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

from posttrain.agentic.parsing import ToolCall, ToolCallError, parse_tool_call, render_tool_result
from posttrain.agentic.tools import Tool
from posttrain.data.formats import encode_segments  # noqa: F401  (re-exported: agentic.encode_segments)
from posttrain.errors import PosttrainError
from posttrain.rewards.functions import answers_match, extract_answer

Segment = tuple[str, bool]  # (text, trainable)


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: Mapping) -> str:
        """Start an episode for a data row; return the first observation (the prompt text)."""
        ...

    def step(self, action: str) -> tuple[Optional[str], float, bool]:
        """Apply the policy's action; return (next observation or None when done, reward, done)."""
        ...


@dataclasses.dataclass
class Episode:
    """One finished (or running) episode: the row, its segments, the reward and what happened."""

    row: Mapping
    segments: list[Segment]
    reward: float = 0.0
    done: bool = False
    turns: int = 0  # actions taken
    tool_calls: int = 0  # calls that ran a tool (successfully parsed, known tool)
    parse_errors: int = 0  # malformed calls
    tool_errors: int = 0  # unknown tools, tools that raised, or tool outputs starting with "Error:"
    calls: list[Union[ToolCall, ToolCallError]] = dataclasses.field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.segments)

    @property
    def final(self) -> str:
        """The last action (what the verifier scored)."""
        return next((t for t, trainable in reversed(self.segments) if trainable), "")


class ToolEnv:
    """Tool use over turns, scored at the end by `verifier(row, final_action)`; see the module docstring.

    `tools`: name -> Tool (or a sequence of tools); `fmt`: the tool-call format ("hermes", "llama3",
    "gemma" or "auto"); `prompt_key`: the row's prompt column; `render(output, fmt) -> text`: how an
    observation is written (default `render_tool_result`, plain text for the byte tokenizer)."""

    def __init__(self, tools: Union[Mapping[str, Tool], Sequence[Tool]], verifier: Callable[[Mapping, str], Any], *,
                 max_turns: int = 4, fmt: str = "hermes", prompt_key: str = "prompt",
                 render: Callable[[str, str], str] = render_tool_result):
        self.tools = dict(tools) if isinstance(tools, Mapping) else {t.name: t for t in tools}
        if not isinstance(max_turns, int) or max_turns < 1:
            raise PosttrainError(f"env.max_turns must be an int >= 1, got {max_turns!r}")
        self.verifier, self.max_turns, self.fmt, self.prompt_key, self.render = (
            verifier, max_turns, fmt, prompt_key, render)
        self.episode: Optional[Episode] = None

    @property
    def segments(self) -> list[Segment]:
        return self.episode.segments if self.episode else []

    def reset(self, row: Mapping) -> str:
        if self.prompt_key not in row:
            raise PosttrainError(f"env: the row has no {self.prompt_key!r} column (it has {sorted(row)}); "
                                 "give each row a prompt or set the env's prompt_key")
        prompt = str(row[self.prompt_key])
        self.episode = Episode(row=row, segments=[(prompt, False)])
        return prompt

    def _run(self, call: ToolCall) -> str:
        """The tool's output for a parsed call; failures become "Error: ..." texts (counted)."""
        ep = self.episode
        tool = self.tools.get(call.name)
        if tool is None:
            ep.tool_errors += 1
            return f"Error: unknown tool {call.name!r}; the tools are {', '.join(sorted(self.tools)) or 'none'}"
        ep.tool_calls += 1
        try:
            out = tool.call(call.arguments)
        except Exception as err:  # a tool's bug must not end a whole rollout
            out = f"Error: the tool {call.name!r} failed: {type(err).__name__}: {err}"
        out = out if isinstance(out, str) else str(out)
        if out.startswith("Error:"):
            ep.tool_errors += 1
        return out

    def step(self, action: str) -> tuple[Optional[str], float, bool]:
        ep = self.episode
        if ep is None or ep.done:
            raise RuntimeError("ToolEnv.step called before reset() or after the episode ended")
        ep.turns += 1
        ep.segments.append((action, True))
        call = parse_tool_call(action, self.fmt, tools=self.tools)
        if call is not None:
            ep.calls.append(call)
        if call is None or ep.turns >= self.max_turns:
            ep.done = True
            ep.reward = float(self.verifier(ep.row, action))
            return None, ep.reward, True
        if isinstance(call, ToolCallError):
            ep.parse_errors += 1
            output = f"Error: could not parse the tool call: {call.message}"
        else:
            output = self._run(call)
        observation = self.render(output, self.fmt if self.fmt != "auto" else call.format)
        ep.segments.append((observation, False))
        return observation, 0.0, False


def run_episode(env: ToolEnv, policy: Callable[[str], str], row: Mapping) -> Episode:
    """Play one episode: `policy(transcript so far) -> action` until the environment says done."""
    transcript = env.reset(row)
    while True:
        action = policy(transcript)
        observation, _, done = env.step(action)
        transcript += action
        if done:
            return env.episode
        transcript += observation


def verify_answer(row: Mapping, final_action: str) -> float:
    """1.0 when the final action's answer (`#### N`, else its last number) equals row["answer"], else 0.0."""
    pred = extract_answer(str(final_action), last_number=True)
    return float(pred is not None and answers_match(pred, str(row["answer"])))
