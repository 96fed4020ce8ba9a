"""A LangGraph agent whose memory is erasable: a worked example (issue 24 item 7).

- Long-term memory in ``KeyshredStore`` (namespace ``("memories", user_id)``): each
  user's items are ciphertext under that user's keys.
- Checkpoints in ``KeyshredSaver``: the thread belongs to the ``user_id`` its config
  carries, as LangGraph apps already pass it.
- Prompts pass through the vault before the model sees them (``PromptGuard``): the
  model gets ``<EMAIL_…>``/``<PHONE_…>`` tokens, never the values, and its answer is
  restored for the user afterwards (only for the purpose the tokens were issued for).
- One user asks to be forgotten: one call erases their memories, vectors, threads
  and tokens, with a signed receipt; the other user's data is untouched.

The model is a fake chat model from ``langchain_core`` that answers from a script,
so the example runs offline (CI runs it: ``tests/test_examples.py``). Swap in any
LangChain chat model. (When keyshred's HTTP API exists the erasure below is one POST;
until then it is the Python API.)

Run: ``.venv/bin/python examples/agent_memory.py [DATA_FOLDER]``; prints what the
model saw and what the users got, then the erasure's receipt.
"""

from __future__ import annotations

import json
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, TypedDict

from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph
from langgraph.store.base import BaseStore

from keyshred import Keyshred
from keyshred.integrations.langgraph import KeyshredSaver, KeyshredStore
from keyshred.vault.sanitizers import PromptGuard

PURPOSE = "support-reply"  # the one purpose the model's tokens may be resolved for


class State(TypedDict):
    message: str
    answer: str


def build_agent(ks: Keyshred, model: Any, seen: list[str]) -> Any:
    """The graph: remember what the user said, answer with their memories in the
    prompt, the prompt sanitized before the model call and the answer restored."""
    store = KeyshredStore(ks, subject_from=1)  # ("memories", user_id, ...)

    def remember(state: State, config: RunnableConfig, *, store: BaseStore) -> dict[str, Any]:
        user = config["configurable"]["user_id"]
        n = len(store.search(("memories", user), limit=100))
        store.put(("memories", user), f"note-{n}", {"text": state["message"]})
        return {}

    def respond(state: State, config: RunnableConfig, *, store: BaseStore) -> dict[str, Any]:
        user = config["configurable"]["user_id"]
        notes = [item.value["text"] for item in store.search(("memories", user), limit=5)]
        guard = PromptGuard(ks.vault, user, purpose=PURPOSE, ttl=timedelta(hours=1))
        messages = guard.sanitize_messages(
            [
                {"role": "system", "content": "You help customers. Known: " + " | ".join(notes)},
                {"role": "user", "content": state["message"]},
            ]
        )
        seen.extend(m["content"] for m in messages)  # what leaves for the model
        reply = model.invoke(
            [
                SystemMessage(content=messages[0]["content"]),
                HumanMessage(content=messages[1]["content"]),
            ]
        )
        if not isinstance(reply, AIMessage):
            raise TypeError("a chat model answers with an AIMessage")
        answer = guard.restore_answer(str(reply.content), caller="agent", purpose=PURPOSE)
        return {"answer": answer}

    graph = StateGraph(State)
    graph.add_node("remember", remember)
    graph.add_node("respond", respond)
    graph.add_edge(START, "remember")
    graph.add_edge("remember", "respond")
    graph.add_edge("respond", END)
    return graph.compile(checkpointer=KeyshredSaver(ks), store=store)


class EchoTokens(FakeListChatModel):
    """A scripted model that, like a real one, repeats what it was given: it answers
    with the tokens it found in the user's message."""

    def _call(self, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any) -> str:
        from keyshred.vault.tokens import TOKEN_RE

        tokens = TOKEN_RE.findall(str(messages[-1].content))
        found = " and ".join(f"<{kind}_{ident}>" for kind, ident in tokens) or "nothing"
        return f"I will write to you at {found}."


def main(folder: Path) -> dict[str, Any]:
    seen: list[str] = []
    with Keyshred.init(folder, exist_ok=True) as ks:
        agent = build_agent(ks, EchoTokens(responses=["unused"]), seen)
        ann = {"configurable": {"thread_id": "ann-chat", "user_id": "ann"}}
        bo = {"configurable": {"thread_id": "bo-chat", "user_id": "bo"}}
        first = agent.invoke({"message": "Mail me at ann.example7@example.com please"}, ann)
        agent.invoke({"message": "My phone is 13812345678"}, ann)
        other = agent.invoke({"message": "Reach me at bo.example7@example.com"}, bo)
        # Ann asks to be forgotten: memories, vectors, threads, tokens, with a receipt.
        req = ks.erase("ann", requested_by="privacy-team", reason="gdpr-art17")
        receipt = ks.erasure.receipt(req.request_id)
        if receipt is None:
            raise RuntimeError(f"the erasure stopped in state {req.state}: {req.error}")
        bo_state = agent.get_state(bo).values
        out = {
            "model_saw": seen,
            "ann_got": first["answer"],
            "bo_got": other["answer"],
            "erasure": req.state,
            "receipt_stores": [(s.store, s.action, s.count) for s in receipt.stores],
            "bo_still_has": bo_state["answer"],
        }
    print(json.dumps(out, indent=2, ensure_ascii=False))
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp) / "agent-data")
