"""Token checkpoints of one session: locate, plan the next prompt, commit, assemble samples (pure).

Why it exists: this is TITO's core (§3). After turn k the session holds the checkpoint
C_k = P_k || O_k: the exact prompt IDs served and the exact output IDs sampled. On turn k+1 the agent
replays the whole history plus new messages; we find the deepest stored checkpoint whose messages
match the replay (a `Matcher` decides), tokenize only the appended messages plus the next assistant
opener, and let the family's merge repair the seam:

    P_{k+1} = merge(C_k, encode(render_appended(S_{k+1})))

Replayed assistant text only locates a checkpoint: an assistant message that matches no stored turn
is refused (400), never tokenized. The checkpoints form an append-only tree of turns (`Node`):

- linear sessions extend the newest turn, or roll back exactly one assistant turn (the dropped
  turn is discarded); an earlier fork is refused (409). One trajectory per session.
- branching sessions attach a turn at the deepest match anywhere (a new root for an unrelated
  prompt); every leaf is one trajectory. A generated span shared by several leaves keeps loss mask
  1 only on the earliest leaf, so its tokens contribute one gradient, not several.

Extending a turn that stopped on the token budget (finish reason "length") is refused (409): the
row has no turn end, and any seam we would invent is text the model never sampled.

Who calls it: lockstep.rollout.session.server (under the session's lock). No I/O, no clock.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from lockstep.models.registry import Message, ModelFamily, Tool
from lockstep.rollout.session.matcher import Matcher, explain_mismatch
from lockstep.types import Sample, SampleStatus


class SessionMode(enum.StrEnum):
    """How a session's history may grow."""

    LINEAR = "linear"
    """Extend the newest turn, or retry it once; one trajectory."""
    BRANCHING = "branching"
    """Append-only tree; one trajectory per leaf."""


class SessionError(Exception):
    """A request the session cannot serve; `status` is the HTTP status the server answers with."""

    status = 400

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


@dataclass(slots=True)
class TurnOutput:
    """What the engine returned for one turn (already checked: one logprob per output token)."""

    ids: list[int]
    """Sampled output token IDs, including the stop token when the engine returns it."""
    logprobs: list[float]
    """Logprob of each sampled token, same length as ids."""
    versions: list[int | None]
    """Weight version that produced each sampled token, same length as ids."""
    finish_reason: str
    """stop | length | abort."""
    routed_experts: bytes | None = None
    """R3 data of this request, int32 [prompt + output - 1, layers, topk], when captured."""
    cached_tokens: int = 0
    """Prompt tokens the engine served from its prefix cache."""


@dataclass(slots=True, eq=False)
class Node:
    """One assistant turn: the tokens it added to its parent's checkpoint, and the reply."""

    id: int
    """Creation order within the session (0, 1, ...)."""
    parent: Node | None
    """The turn this one extends; None for a root (a freshly rendered prompt)."""
    messages: tuple[Message, ...]
    """Messages this turn covers: the appended ones (a whole prompt for a root), then the reply."""
    trim: int
    """Tokens dropped from the end of the parent's row before `ids` (family merge, at most 1)."""
    ids: list[int]
    """Added prompt tokens (seam bridge, appended messages, assistant opener), then output tokens."""
    prompt_len: int
    """How many leading entries of `ids` are prompt (environment) tokens."""
    logprobs: list[float]
    """Rollout logprob of each output token."""
    versions: list[int | None]
    """Weight version of each output token."""
    finish_reason: str
    """How the turn ended: stop | length | abort."""
    row_len: int
    """Length of the checkpoint C_k this turn ends with."""
    routed_experts: bytes | None = None
    """R3 data of the turn's request; dropped once the turn has a child (the child's covers it)."""
    cached_tokens: int = 0
    """Prompt tokens served from the engine's prefix cache for this turn."""
    children: list[Node] = field(default_factory=list)
    """Turns that extend this one, in creation order."""

    @property
    def output_len(self) -> int:
        return len(self.ids) - self.prompt_len


@dataclass(slots=True)
class Plan:
    """The next turn's prompt, computed before calling the engine and committed after it."""

    parent: Node | None
    """Checkpoint the turn extends (None: a fresh prompt)."""
    appended: tuple[Message, ...]
    """Replayed messages after the checkpoint (tokenized this turn)."""
    input_ids: list[int]
    """The full prompt sent to the engine: parent row (minus trim) + added."""
    trim: int
    """Tokens dropped from the parent row's end."""
    added: list[int]
    """Tokens after the kept parent row."""
    discard: Node | None = None
    """Linear rollback: the newest turn, dropped when this turn commits."""
    reused: int = 0
    """Prompt tokens taken from the stored checkpoint instead of being tokenized."""
    removed: list[int] = field(default_factory=list)
    """Tokens the merge trimmed from the parent row (restored by abandon)."""
    tools: tuple[Tool, ...] = ()
    """Tool schemas of the request (rendered into a fresh prompt by families that declare tools)."""


class TokenTree:
    """The checkpoints of one session (not thread-safe: the server serializes turns per session)."""

    def __init__(
        self, family: ModelFamily, mode: SessionMode, matcher: Matcher, max_nodes: int = 256
    ) -> None:
        self.family = family
        """Model family: template, tokenizer and seam merge."""
        self.mode = mode
        """Linear or branching."""
        self.matcher = matcher
        """Decides whether a replayed message may reuse a stored one."""
        self.max_nodes = max_nodes
        """Cap on stored turns of a branching session (memory bound); 409 beyond it."""
        self.roots: list[Node] = []
        """Turns without parent, in creation order."""
        self.head: Node | None = None
        """The newest committed turn (the linear trajectory's end)."""
        self._next_id = 0
        self._count = 0
        # The newest checkpoint's row, kept so that extending it (the common case) costs no
        # walk over the path; replaced on every commit.
        self._cached: tuple[Node, list[int]] | None = None
        self.tools: tuple[Tool, ...] = ()
        """Tool schemas the session started with; they are part of the rendered prompt, so fixed."""
        self._tools_key: str | None = None

    # -- locating and planning -------------------------------------------------------------------

    def _locate(self, msgs: Sequence[Message]) -> tuple[int, Node | None]:
        """Deepest turn whose messages match a prefix of msgs: (messages matched, node)."""
        best: tuple[int, Node | None] = (0, None)
        stack: list[tuple[Node, int]] = [(n, 0) for n in reversed(self.roots)]
        while stack:
            node, start = stack.pop()
            end = start + len(node.messages)
            if end > len(msgs):
                continue
            if not all(self.matcher(s, r) for s, r in zip(node.messages, msgs[start:end], strict=True)):
                continue
            if end > best[0]:
                best = (end, node)
            stack.extend((c, end) for c in reversed(node.children))
        return best

    def _check_fork(self, parent: Node | None) -> Node | None:
        """Apply the linear rule; returns the turn a rollback discards."""
        if self.mode is SessionMode.BRANCHING:
            if self._count >= self.max_nodes:
                raise SessionError(
                    f"session holds max_nodes={self.max_nodes} turns; delete it or create it with a larger max_nodes",
                    409,
                )
            return None
        head = self.head
        if head is None or parent is head:
            return None
        if parent is head.parent:
            return head  # retry of the newest assistant turn
        raise SessionError(
            "the replayed history forks more than one assistant turn back; linear sessions allow "
            "retrying only the newest turn (create the session with mode=branching to fork)",
            409,
        )

    def _explain_unmatched(self, msgs: Sequence[Message], matched: int, parent: Node | None) -> str:
        candidates = parent.children if parent is not None else self.roots
        for c in candidates:
            for j, stored in enumerate(c.messages):
                i = matched + j
                if i < len(msgs) and stored.role == "assistant" and msgs[i].role == "assistant":
                    return f"messages[{i}] (assistant): {explain_mismatch(stored, msgs[i])}"
        return f"messages[{matched}:] contain an assistant turn this session never produced"

    def plan(self, msgs: Sequence[Message], tools: Sequence[Tool] = ()) -> Plan:
        """The next prompt for a replayed history, or SessionError naming what to fix."""
        if not msgs:
            raise SessionError("messages is empty; send the conversation so far")
        key = json.dumps(list(tools), sort_keys=True)
        if self._tools_key is not None and key != self._tools_key:
            raise SessionError(
                "tools differ from the tools this session started with; they are rendered into the "
                "stored prompt, so keep them fixed within a session (or create a new session)"
            )
        matched, parent = self._locate(msgs)
        appended = tuple(msgs[matched:])
        if not appended:
            raise SessionError(
                f"messages end with an assistant turn already in this session (messages[{matched - 1}]); "
                "append a tool or user message before asking for the next reply"
            )
        if self._count and any(m.role == "assistant" for m in appended):
            raise SessionError(
                self._explain_unmatched(msgs, matched, parent)
                + "; replay assistant turns as returned (or pick matcher=loose_tool_call for "
                "re-serialized tool arguments): assistant text is never re-tokenized"
            )
        if parent is not None and parent.finish_reason == "length":
            raise SessionError(
                f"turn {parent.id} stopped on the token budget (finish_reason=length); it cannot be extended",
                409,
            )
        discard = self._check_fork(parent)
        try:
            plan = self._build(parent, appended, discard, tuple(tools))
            plan.tools = tuple(tools)
            return plan
        except ValueError as exc:
            raise SessionError(f"messages cannot be tokenized for family {self.family.name}: {exc}") from exc

    def _build(
        self,
        parent: Node | None,
        appended: tuple[Message, ...],
        discard: Node | None,
        tools: tuple[Tool, ...],
    ) -> Plan:
        if parent is None:
            ids = self.family.encode_messages(appended, add_generation_prompt=True, tools=tools)
            return Plan(None, appended, ids, 0, list(ids), discard, 0)
        row = self._cached[1] if self._cached is not None and self._cached[0] is parent else self.row(parent)
        suffix = self.family.codec.encode(self.family.render_appended(appended, add_generation_prompt=True))
        merge = self.family.merge(row[-4:], suffix)
        trim, added = merge.trim, [*merge.bridge, *merge.suffix]
        if trim == 1 and not merge.bridge and merge.suffix and row[-1] == merge.suffix[0]:
            # GLM-4.7: the sampled stop token *is* the next opener. Keep the sampled token (its
            # logprob and mask: the policy learned to stop) instead of a re-tokenized copy.
            trim, added = 0, list(merge.suffix[1:])
        kept = len(row) - trim
        # Build the prompt in the checkpoint's own list (no 64K-token copy per turn): the row is
        # lent to the plan until commit() turns it into C_k or abandon() restores it.
        removed = row[kept:]
        del row[kept:]
        row.extend(added)
        self._cached = None
        return Plan(parent, appended, row, trim, added, discard, kept, removed)

    # -- committing ------------------------------------------------------------------------------

    def abandon(self, plan: Plan) -> None:
        """Give back a plan whose turn failed (engine error): the parent's row is restored."""
        row = plan.input_ids
        del row[plan.reused :]
        row.extend(plan.removed)
        if plan.parent is not None:
            self._cached = (plan.parent, row)

    def commit(self, plan: Plan, reply: Message, out: TurnOutput) -> Node:
        """Store the turn C_k = P_k || O_k after the engine answered.

        plan.input_ids is extended in place into C_k (read its length before committing).
        """
        n_out = len(out.ids)
        if not (len(out.logprobs) == len(out.versions) == n_out):
            raise SessionError(
                f"engine returned {n_out} output tokens but {len(out.logprobs)} logprobs and "
                f"{len(out.versions)} versions",
                502,
            )
        node = Node(
            id=self._next_id,
            parent=plan.parent,
            messages=(*plan.appended, reply),
            trim=plan.trim,
            ids=[*plan.added, *out.ids],
            prompt_len=len(plan.added),
            logprobs=list(out.logprobs),
            versions=list(out.versions),
            finish_reason=out.finish_reason,
            row_len=len(plan.input_ids) + n_out,
            routed_experts=out.routed_experts,
            cached_tokens=out.cached_tokens,
        )
        if plan.discard is not None:
            self._remove(plan.discard)
        siblings = plan.parent.children if plan.parent is not None else self.roots
        siblings.append(node)
        if plan.parent is not None:
            plan.parent.routed_experts = None  # the child's request covers the parent's tokens
        self._next_id += 1
        self._count += 1
        self.head = node
        if self._tools_key is None:
            self.tools = plan.tools
            self._tools_key = json.dumps(list(plan.tools), sort_keys=True)
        row = plan.input_ids
        row.extend(out.ids)
        self._cached = (node, row)
        return node

    def _remove(self, node: Node) -> None:
        siblings = node.parent.children if node.parent is not None else self.roots
        siblings.remove(node)
        self._count -= 1 + sum(1 for _ in _descendants(node))

    # -- reading ---------------------------------------------------------------------------------

    @staticmethod
    def path(node: Node) -> list[Node]:
        """Root-to-node turns."""
        out: list[Node] = []
        cur: Node | None = node
        while cur is not None:
            out.append(cur)
            cur = cur.parent
        out.reverse()
        return out

    def row(self, node: Node) -> list[int]:
        """The checkpoint C_k of `node`: every token of its trajectory, as served and sampled."""
        if self._cached is not None and self._cached[0] is node:
            return list(self._cached[1])
        row: list[int] = []
        for n in self.path(node):
            if n.trim:
                del row[len(row) - n.trim :]
            row.extend(n.ids)
        return row

    def messages(self, node: Node) -> list[Message]:
        """The stored conversation ending with `node`'s reply (assistant turns as the server parsed them)."""
        return [m for n in self.path(node) for m in n.messages]

    def leaves(self) -> list[Node]:
        """Kept trajectories' ends: the head for linear sessions, every leaf (creation order) otherwise."""
        if self.mode is SessionMode.LINEAR:
            return [self.head] if self.head is not None else []
        out = [n for r in self.roots for n in (r, *_descendants(r)) if not n.children]
        return sorted(out, key=lambda n: n.id)

    @property
    def node_count(self) -> int:
        return self._count

    def samples(self) -> list[Sample]:
        """One Sample per kept leaf; a span shared by several leaves trains only on the earliest."""
        leaves = self.leaves()
        if not leaves:
            raise SessionError("the session has no completed turn; nothing to assemble", 422)
        claimed: set[int] = set()
        out: list[Sample] = []
        for index, leaf in enumerate(leaves):
            sample = self._assemble(leaf, claimed)
            sample.index = index
            out.append(sample)
            claimed.update(n.id for n in self.path(leaf))
        return out

    def _assemble(self, leaf: Node, claimed: set[int]) -> Sample:
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int | None] = []
        path = self.path(leaf)
        for n in path:
            if n.trim:
                for seq in (ids, mask, logprobs, versions):
                    del seq[len(seq) - n.trim :]
            owned = n.id not in claimed
            n_out = n.output_len
            ids.extend(n.ids)
            mask.extend([0] * n.prompt_len + [1 if owned else 0] * n_out)
            logprobs.extend([0.0] * n.prompt_len + (n.logprobs if owned else [0.0] * n_out))
            versions.extend([None] * n.prompt_len + n.versions)
        p = path[0].prompt_len
        if len(ids) != leaf.row_len or any(mask[:p]):
            raise SessionError(
                f"leaf {leaf.id}: assembled {len(ids)} tokens, checkpoint has {leaf.row_len}", 422
            )
        status = {"length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}.get(
            leaf.finish_reason, SampleStatus.COMPLETED
        )
        sample = Sample(
            group_index=0,
            index=0,
            prompt_ids=ids[:p],
            response_ids=ids[p:],
            loss_mask=mask[p:],
            rollout_logprobs=logprobs[p:],
            token_versions=versions[p:],
            status=status,
            routed_experts=leaf.routed_experts,
            metadata={"leaf": leaf.id, "turns": len(path), "finish_reason": leaf.finish_reason},
        )
        try:
            sample.check()
        except ValueError as exc:
            raise SessionError(str(exc), 422) from exc
        return sample


def _descendants(node: Node) -> list[Node]:
    out: list[Node] = []
    stack = list(node.children)
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children)
    return out
