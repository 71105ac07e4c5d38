"""A readable agent session for a real instruct model: each turn pastes a piece of Python's standard library, as a
tool's result would arrive, and asks about it; the prompt grows by a few hundred tokens a turn."""
import functools
import heapq
import inspect
import json
import shutil
import subprocess
import textwrap

from kvturn.bench.workload import Conversation, Turn

SYSTEM = ("You are a helpful Python assistant working in a terminal. The user runs tools and pastes their output. "
          "Answer in two or three sentences.")
STEPS = [  # (code whose source a tool printed, the question about it)
    (textwrap.dedent, "What does this function do?"),
    (json.dumps, "Which argument makes the output indented, and what does sort_keys do?"),
    (functools.lru_cache, "What happens when maxsize is None?"),
    (subprocess.run, "How do I capture the output of a command as text?"),
    (shutil.which, "Where does this function look for the program?"),
    (heapq.nlargest, "Why does it use a heap instead of sorting everything?"),
    (shutil.rmtree, "Is it safe to call on a directory that contains symbolic links?"),
    (textwrap.TextWrapper._wrap_chunks, "What is the width parameter used for here?"),
]


def tool_result(code, question: str) -> str:
    name = f"{code.__module__}.{code.__qualname__}"
    return f"$ python -c 'import inspect; print(inspect.getsource({name}))'\n{inspect.getsource(code)}\n{question}"


def conversations(turns: int = len(STEPS), answer_tokens: int = 64, sessions: int = 1) -> list[Conversation]:
    """`sessions` sessions (the same questions, ids of their own) of `turns` turns (at most len(STEPS)); answers
    end at the model's own end of turn."""
    return [Conversation("python-help" if i == 0 else f"python-help-{i}", SYSTEM,
                         [Turn(tool_result(code, question), answer_tokens) for code, question in STEPS[:turns]])
            for i in range(sessions)]


def question_of(user_text: str) -> str:
    """The question a turn asked, without the pasted tool output."""
    return user_text.rstrip().rsplit("\n", 1)[-1]
