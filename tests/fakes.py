"""Small stand-ins shared by tests: an environment with ragged tool responses."""

from __future__ import annotations

from keel.types import Observation, Task, ToolCall


class EchoEpisode:
    def __init__(self, task: Task, lengths: list[int]):
        self.task = task
        self.lengths = lengths
        self.calls = 0
        self.closed = False

    def execute(self, call: ToolCall) -> Observation:
        n = self.lengths[self.calls % len(self.lengths)]
        self.calls += 1
        if call.error:
            return Observation(text="[]", ok=False, error=call.error)
        return Observation(text="[" + ", ".join(f'"item{k}"' for k in range(n)) + "]", ok=True, items=[f"item{k}" for k in range(n)])

    def next_user_message(self):
        return None

    def close(self):
        self.closed = True


class EchoEnv:
    """Answers every call with a list whose length cycles through `lengths` (ragged responses)."""

    name = "echo"

    def __init__(self, lengths=(1, 7, 3, 12)):
        self.lengths = list(lengths)
        self.episodes: list[EchoEpisode] = []

    def tools(self, task):
        return [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]

    def system_prompt(self, task):
        return "Answer with <answer>X</answer>."

    def user_message(self, task):
        return task.question

    def start(self, task):
        ep = EchoEpisode(task, self.lengths[int(task.id) % len(self.lengths) :] + self.lengths[: int(task.id) % len(self.lengths)])
        self.episodes.append(ep)
        return ep


def make_tasks(n: int) -> list[Task]:
    return [Task(id=str(i), question=f"What is item {i}?", answers=[f"item{i}"]) for i in range(n)]
