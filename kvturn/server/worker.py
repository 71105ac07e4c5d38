"""One worker: engine + KV connector, and turning an OpenAI request into a sequence the engine runs.

Role `prefill` computes prompts and pins their blocks for a decode worker; role `decode` reads them, decodes,
and (with bidirectional transfer) retains the finished turn's blocks for the next turn's prefill; role `both`
is the colocated baseline.
"""
import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from kvturn.config import WorkerConfig
from kvturn.engine.async_engine import AsyncEngine
from kvturn.engine.block_manager import salt_seed
from kvturn.engine.calibration import time_prefill_steps
from kvturn.engine.llm_engine import LLMEngine
from kvturn.engine.sampling import SamplingParams
from kvturn.engine.sequence import Sequence
from kvturn.errors import BadRequest
from kvturn.kv_transfer import params as kv_params
from kvturn.kv_transfer import policy
from kvturn.kv_transfer.connector import KVConnector, RemoteBlocks, RetainSpec
from kvturn.kv_transfer.nixl_agent import LayoutMismatch
from kvturn.kv_transfer.params import HOST, POOL
from kvturn.kv_transfer.side_channel import LEASE, PIN, PeerClient, parse_lease, token_id
from kvturn.model.loader import load_model
from kvturn.model.tokenizer import ChatTemplateError, ChatTokenizer
from kvturn.server.metrics import WorkerMetrics
from kvturn.server.openai import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("kvturn.worker")
PROMPT_THREADS = 4  # prompts rendered and tokenized at once, off the event loop (the tokenizer lets the GIL go)
# English runs ~4 characters a token and code 3 to 5: a text longer than this many per token of the context is
# counted piece by piece before it is tokenized whole, so that one far too long is refused after its first pieces.
LIKELY_CHARS_PER_TOKEN = 8


def record_is_current(record: dict, kind: str, peer) -> bool:
    """Whether a relayed lease record can still say where the blocks are: not when it names the pool of a peer
    with a host tier (the lease may have moved there since; the peer's own answer says where it is now), nor when
    it carries no time left (a router that does not count it down)."""
    if record.get("ttl_s") is None:
        return False
    return kind == PIN or record.get("tier", POOL) == HOST or not peer.host_blocks


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.tokenizer = ChatTokenizer(config.model_dir)
        model = load_model(config.model_dir)
        self.model_name = config.served_model_name or Path(config.model_dir).name
        self.vocab_size = model.config.vocab_size
        eos = set(model.config.eos_token_ids) | {self.tokenizer.eos_token_id}
        self.engine = LLMEngine(model, config.engine, emit=lambda out: None, detokenize=self.tokenizer.decode,
                                eos_token_ids=eos)
        self.connector = KVConnector(self.engine, config.connector) if config.transfers_kv else None
        # Before any request comes (the steps use free blocks only), with the NIXL agent's threads running.
        self.calibration = time_prefill_steps(self.engine) if config.calibrate else []
        self.async_engine = AsyncEngine(self.engine)
        self.metrics = WorkerMetrics(self.engine, self.connector, self.model_name)
        connector_config = config.connector
        self.advertise_host = config.advertise_host or config.host
        self.peers = PeerClient(connector_config.cluster_secret, connector_config.side_channel_timeout_s,
                                connector_config.trusted_peers, f"{self.advertise_host}:{config.port}")
        self._background: set[asyncio.Task] = set()
        self._connecting: set[str] = set()  # peers connect_back is connecting to
        self._prompts = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="kvturn-prompt")
        if connector_config.cluster_secret is None:
            log.warning("no cluster secret: this worker trusts any caller that can reach it with kv_transfer_params "
                        "and its side channel, as vLLM's servers trust their network. Set KVTURN_CLUSTER_SECRET "
                        "(kvturn serve makes one per stack).")

    @property
    def engine_id(self) -> str:
        return self.connector.engine_id if self.connector else "colocated"

    def chat_prompt(self, messages) -> str:
        try:
            return self.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages])
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), param="messages") from None

    async def off_loop(self, fn, *args):
        """`fn(*args)` on a prompt thread: rendering and tokenizing a long prompt takes seconds, during which the
        event loop must go on answering /health, the registry's heartbeat and every other request."""
        return await asyncio.get_running_loop().run_in_executor(self._prompts, fn, *args)

    def stop_prompt_threads(self) -> None:
        """At shutdown: prompts waiting for a thread are dropped; one being tokenized ends on its own (bounded)."""
        self._prompts.shutdown(wait=False, cancel_futures=True)

    def prompt_ids(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            return self.encode_prompt(self.chat_prompt(body.messages), "messages")
        if isinstance(body.prompt, str):
            return self.encode_prompt(body.prompt, "prompt")
        self.check_token_ids(body.prompt, "prompt")
        return list(body.prompt)

    def encode_prompt(self, text: str, param: str) -> list[int]:
        """The prompt's token ids; a text too long for the context is refused before it is tokenized whole, which
        takes seconds a MB: at once when even the longest tokens could not hold it, else after the pieces that
        take its count past the context (a few hundred KB)."""
        max_model_len = self.engine.max_model_len
        if len(text) > max_model_len * self.tokenizer.max_token_chars:
            raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                             f"has {len(text)} characters, more than that many tokens can hold.", param=param)
        if len(text) > max_model_len * LIKELY_CHARS_PER_TOKEN and self.tokenizer.exceeds(text, max_model_len):
            raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                             f"has more than {max_model_len} tokens.", param=param)
        return self.tokenizer.encode(text)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise BadRequest(f"{param} token ids must lie in [0, {self.vocab_size})", param=param)

    def sampling_params(self, body, num_prompt_tokens: int) -> SamplingParams:
        max_model_len = self.engine.max_model_len
        if body.model is not None and body.model != self.model_name:
            raise BadRequest(f"The model `{body.model}` does not exist.", status=404, param="model")
        if body.echo:
            raise BadRequest("echo is not supported", param="echo")
        try:
            num_logprobs = body.num_logprobs
        except ValueError as exc:
            raise BadRequest(str(exc), param="top_logprobs")
        if num_logprobs is not None and num_logprobs > self.config.max_logprobs:
            raise BadRequest(f"at most {self.config.max_logprobs} logprobs per token", param="logprobs")
        if num_prompt_tokens == 0:
            raise BadRequest("the prompt is empty", param="prompt")
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if num_prompt_tokens >= max_model_len:
            raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                             f"has {num_prompt_tokens} tokens.", param="messages")
        if max_tokens is None:
            max_tokens = min(self.config.default_max_output_tokens, max_model_len - num_prompt_tokens)
        if num_prompt_tokens + max_tokens > max_model_len:
            raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                             f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                             f"in the completion). Please reduce the length of the prompt or completion.",
                             param="max_tokens")
        blocks = -(-(num_prompt_tokens + 1) // self.engine.block_size)
        if blocks > self.engine.max_prompt_blocks:
            raise BadRequest(f"the prompt needs {blocks} KV blocks but this worker's pool holds "
                             f"{self.engine.max_prompt_blocks}", param="messages")
        self.check_token_ids(body.stop_token_ids, "stop_token_ids")
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=max(body.top_k, 0), seed=body.seed, stop=body.stop or [],
                              stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=num_logprobs)

    def connect_back(self, address: str) -> None:
        """A peer of the cluster fetched our agent info to read from us: connect to it too, in the background,
        so that our first read from it (the first turn that reuses its KV) does not pay the NIXL handshake."""
        if self.connector is None or address in self.peers.known or address in self._connecting:
            return
        self._connecting.add(address)

        async def connect():
            try:
                info = await self.peers.agent_info(address)
                await self.async_engine.call(lambda: self.connector.nixl.add_peer(info))
            except Exception as exc:  # an optimisation only: the first read connects if this did not
                log.info("could not connect back to peer %r: %r", address, exc)
            finally:
                self._connecting.discard(address)

        task = asyncio.get_running_loop().create_task(connect())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def resolve_remote(self, ref: kv_params.RemoteRef, prefilled_for_us: bool,
                             vouched: bool) -> RemoteBlocks | str:
        """Handshake with the peer if needed and get its own account of the lease (from the peer, or relayed by
        a `vouched` caller of the cluster); a reason string on failure."""
        nixl = self.connector.nixl
        try:
            info = await self.peers.agent_info(ref.address)
            if ref.engine_id and info["engine_id"] != ref.engine_id:
                stale = info["engine_id"]
                info = await self.peers.agent_info(ref.address, refresh=True)
                if info["engine_id"] != stale:  # the peer at this address restarted: drop its old NIXL agent
                    await self.async_engine.call(lambda: nixl.forget_peer(stale))
        except (httpx.HTTPError, ValueError):
            return policy.PEER_UNREACHABLE
        if ref.engine_id and info["engine_id"] != ref.engine_id:
            return policy.LEASE_UNKNOWN  # the peer restarted: its leases died with it
        try:
            peer = nixl.peers.get(info["engine_id"]) or await self.async_engine.call(lambda: nixl.add_peer(info))
        except LayoutMismatch as exc:
            log.error("refusing peer %r: %s", ref.address, exc)
            return policy.LAYOUT_MISMATCH
        except ValueError as exc:
            log.warning("peer %r sent malformed agent info: %s", ref.address, exc)
            return policy.BAD_PEER_REPLY
        except Exception:
            log.warning("NIXL handshake with %r failed", ref.address, exc_info=True)
            return policy.PEER_UNREACHABLE
        kind = PIN if prefilled_for_us else LEASE
        if vouched and self.peers.record_is_bound(ref, kind) and record_is_current(ref.record, kind, peer):
            # The peer's own account of its lease (P's pin for this request, or D's lease from the last turn),
            # relayed by a caller holding the cluster secret: no round trip to the peer before the read. What the
            # peer's answer would add is checked here: its MAC binds the lease to this conversation (or request),
            # the block hashes must match this prompt's, the time left is in the record, and the epochs read back
            # after the bytes prove the blocks were not recycled meanwhile.
            remote = parse_lease(ref.record, peer, ref.handle, self.engine.block_size, self.vocab_size,
                                 self.connector.clock()) or policy.BAD_PEER_REPLY
        else:
            remote = await self.peers.acquire(ref, peer, self.engine.block_size, self.vocab_size,
                                              self.connector.clock)
        if isinstance(remote, RemoteBlocks):
            remote.prefilled_for_us = prefilled_for_us
        return remote

    async def prepare(self, body, conversation_key: str | None, caller_has_secret: bool, request_id: str,
                      arrival: float) -> tuple[Sequence, kv_params.KVPlan]:
        prompt = await self.off_loop(self.prompt_ids, body)
        tokenized = time.perf_counter()
        params = self.sampling_params(body, len(prompt))
        try:
            plan = kv_params.plan(body.kv_transfer_params, conversation_key)
        except kv_params.BadKVParams as exc:
            raise BadRequest(str(exc), param="kv_transfer_params")
        role, connector = self.config.role, self.connector
        retain = None
        if plan.prefill_for_remote_decode:
            if role == "decode" or connector is None:
                raise BadRequest("this worker cannot prefill for a remote decode (role "
                                 f"{role}, transfer {'on' if connector else 'off'})", param="kv_transfer_params")
            params.max_tokens = 1
            retain = RetainSpec(self.config.connector.kv_pin_timeout_s, request_id, release_after_read=True)
        elif role == "prefill":
            raise BadRequest("this is a prefill worker: send kv_transfer_params.do_remote_decode=true",
                             param="kv_transfer_params")
        elif self.config.bidirectional and conversation_key:
            retain = RetainSpec(self.config.connector.decoder_kv_blocks_ttl_s, conversation_key,
                                release_after_read=False,
                                covered=min(plan.prefill_cached_tokens / max(len(prompt), 1), 1.0))
        remote, declined, side_channel_s = None, None, 0.0
        reads_remote = plan.remote is not None and (self.config.bidirectional or not plan.prefill_for_remote_decode)
        if reads_remote:  # D->P reads need --bidirectional on this worker; P->D reads always happen
            if connector is None:
                declined = policy.PEER_UNREACHABLE
            elif refused := self.peers.may_contact(plan.remote, caller_has_secret,
                                                   LEASE if plan.prefill_for_remote_decode else PIN):
                # Checked before any contact: the secret is shown only to a peer the cluster itself named.
                log.warning("request %s named peer %r that this worker may not contact (%s); computing instead",
                            request_id, plan.remote.address, refused)
                declined = refused
                plan = kv_params.KVPlan(plan.prefill_for_remote_decode, None)  # nothing to release there either
            else:
                resolve_started = time.perf_counter()
                vouched = caller_has_secret and not self.peers.open_cluster
                resolved = await self.resolve_remote(plan.remote, not plan.prefill_for_remote_decode, vouched)
                side_channel_s = time.perf_counter() - resolve_started
                if isinstance(resolved, str):
                    declined = resolved
                else:
                    remote = resolved
        seq = Sequence(request_id, prompt, params, remote=remote, retain=retain, hash_seed=salt_seed(body.cache_salt))
        seq.first_token_id = self.prefill_first_token(plan, remote, params, caller_has_secret)
        seq.timing.arrival = arrival
        seq.timing.tokenize_s = tokenized - arrival
        seq.timing.side_channel_s = side_channel_s
        if declined:
            seq.reuse_outcome = declined
            if connector is not None:
                self.engine.call_soon(lambda: connector.stats.reuse_declines.update([declined]))
        return seq, plan

    def prefill_first_token(self, plan: kv_params.KVPlan, remote: RemoteBlocks | None, params: SamplingParams,
                            caller_has_secret: bool) -> int | None:
        """The token P sampled after the prompt, which a decode worker continues from instead of sampling its
        own, whether or not it can use P's blocks: the router may have sent that token to the client already.
        Taken from P's own record, or, when P could not be asked, from the one relayed by a caller of the cluster
        (anyone else would choose the answer's first token)."""
        if plan.remote is None or plan.prefill_for_remote_decode or params.must_sample_here:
            return None
        if remote is not None:
            return remote.first_token_id
        if not caller_has_secret:
            return None
        return token_id((plan.remote.record or {}).get("first_token_id"), self.vocab_size)

    def response_kv_params(self, seq: Sequence) -> dict | None:
        if seq.retained is None:
            return None
        kind = PIN if seq.retain.release_after_read else LEASE
        binding = self.peers.binding(kind, self.engine_id, f"{self.advertise_host}:{self.config.port}",
                                     seq.retain.conversation_key, seq.retained)
        return kv_params.retention_params(seq.retained, self.engine_id, seq.request_id, self.advertise_host,
                                          self.config.port, for_decode=seq.retain.release_after_read, binding=binding)

    def kvturn_fields(self, seq: Sequence) -> dict:
        t = seq.timing
        ttft = (t.first_token - t.arrival) if t.first_token else 0.0
        return {
            "role": self.config.role,
            "engine_id": self.engine_id,
            "prompt_tokens_computed": seq.num_prompt_tokens - seq.num_cached_tokens - seq.num_remote_tokens,
            "prompt_tokens_cached": seq.num_cached_tokens,
            "prompt_tokens_cached_host": seq.num_host_cached_tokens,  # of them, from the prefix cache's host tier
            "prompt_tokens_remote": seq.num_remote_tokens,
            "completion_tokens": seq.num_output_tokens,
            "reuse": seq.reuse_outcome,
            "kv_tier": seq.kv_tier,  # where the reused history lived: the peer's pool or host tier, or our own host
            "kv_read_bytes": t.kv_read_bytes,
            "host_restore_bytes": t.host_restore_bytes,
            "timing": {
                "ttft_ms": ttft * 1e3,
                "kv_read_ms": t.kv_read_s * 1e3,
                "kv_read_step_ms": t.kv_read_step_s * 1e3,  # of it, engine steps that ran before it was seen done
                "kv_read_hidden_ms": t.kv_read_hidden_s * 1e3,  # of it, what its own step's compute covered
                "prefill_compute_ms": t.prefill_compute_s * 1e3,
                "prefill_shared_tokens": t.prefill_shared_tokens,
                "queue_ms": max(ttft - (t.kv_read_s - t.kv_read_hidden_s) - t.prefill_compute_s, 0.0) * 1e3,
                "tokenize_ms": t.tokenize_s * 1e3,
                "side_channel_ms": t.side_channel_s * 1e3,
                "engine_wait_ms": ((t.first_scheduled or t.arrival) - (t.submitted or t.arrival)) * 1e3,
                "host_restore_ms": t.host_restore_s * 1e3,  # copying the history back from our own host tier
            },
        }

    def usage(self, seq: Sequence) -> dict:
        """OpenAI's usage; cached tokens are those this request did not compute: the local prefix cache's and a
        lease's read back, not P's blocks a decode worker read (P computed them for this very request)."""
        pulled_from_prefill = seq.remote is not None and seq.remote.prefilled_for_us
        cached = seq.num_cached_tokens + (0 if pulled_from_prefill else seq.num_remote_tokens)
        return {"prompt_tokens": seq.num_prompt_tokens, "completion_tokens": seq.num_output_tokens,
                "total_tokens": len(seq), "prompt_tokens_details": {"cached_tokens": cached}}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def forget_peer(self, engine_id: str) -> None:
        """A read from the peer failed: it may have died or restarted. Ask it afresh next time (a relayed record
        names the old engine, which the cached agent info would still match) rather than post reads to a ghost."""
        self.peers.forget(engine_id)
        self.engine.call_soon(lambda: self.connector.nixl.forget_peer(engine_id))

    def release_pin_once(self, plan: kv_params.KVPlan, released: list[bool]) -> None:
        """D tells P it no longer needs P's pinned prompt blocks (after the read, or when giving up)."""
        if plan.remote is not None and not plan.prefill_for_remote_decode and not released[0]:
            released[0] = True
            asyncio.get_running_loop().create_task(self.peers.release(plan.remote))

    def observe(self, seq: Sequence) -> None:
        if seq.remote is not None and seq.reuse_outcome in (policy.READ_FAILED, policy.PEER_UNREACHABLE):
            self.forget_peer(seq.remote.peer_engine_id)
        t = seq.timing
        if t.first_token:
            self.metrics.ttft.observe(t.first_token - t.arrival)
        self.metrics.e2e.observe(time.perf_counter() - t.arrival)
