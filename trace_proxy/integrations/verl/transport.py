"""verl's LLM client with generate sent over HTTP through trace-proxy.

Mixed in right under the client class verl built (`LLMServerClient`, or
`FullyAsyncLLMServerClient`, whose abort/resume loop calls this one's `generate`), so verl's
load balancer still picks the server (`_acquire_server`, sticky per request id, least
loaded) and is told when the call ends (`_release_server`). Only the hop changes: instead of
a Ray call to the server actor, an HTTP request through the proxy to that server's own HTTP
address. What verl gets back is what its server's `generate` returns (see mapping.py).

`global_steps`, the policy version verl's server returns with every generate, is read from
the server actor for each call as it is admitted (see `admission.py`): the version of the
weights that generate the call, which verl's asynchronous trainers change only while the
server's gate is closed. It goes back to verl and, as `X-Rollout-Weight-Version`, to the
proxy, which records it as the call's `weight_version`. Inputs HTTP cannot carry, and calls
made while the proxy cannot be reached, take verl's own path (counted, logged once).
"""

from __future__ import annotations

from typing import Any

from trace_proxy.integrations.verl.admission import admit
from trace_proxy.integrations.verl.context import CURRENT_RUN
from trace_proxy.integrations.verl.link import ProxyLink, ProxyUnreachable, ServerUnreachable
from trace_proxy.integrations.verl.mapping import unsupported_sampling

LINK_ATTRIBUTE = "_trace_proxy_link"


class TracedGenerate:
    """The mixin; `_trace_proxy_link` is set on the instance (see `install`)."""

    _trace_proxy_link: ProxyLink

    def _http_unsupported(
        self, image_data: Any, video_data: Any, audio_data: Any, mm_kwargs: Any,
        sampling_params: dict[str, Any], kwargs: dict[str, Any],
    ) -> str | None:  # fmt: skip
        """Why this call must take verl's own path, or None."""
        if image_data is not None or video_data is not None or audio_data is not None:
            return "multimodal"
        if mm_kwargs or kwargs.get("mm_processor_output") is not None:
            return "multimodal"
        extra = set(kwargs) - {"priority", "mm_processor_output"}
        if extra:
            return "argument:" + sorted(extra)[0]
        rollout = self.config.actor_rollout_ref.rollout  # type: ignore[attr-defined]
        if rollout.get("enable_rollout_routing_replay", False):
            return "routed_experts"
        if (rollout.get("disaggregation") or {}).get("enabled", False):
            return "pd_disaggregation"
        if int(self.config.actor_rollout_ref.model.get("lora_rank", 0) or 0) > 0:  # type: ignore[attr-defined]
            return "lora"
        if rollout.get("full_determinism", False):
            return "full_determinism"  # the seed depends on the replica's rank
        if "prompt_logprobs" in sampling_params:
            return "prompt_logprobs"
        name = unsupported_sampling(self._trace_proxy_link.limits.engine, sampling_params)
        return None if name is None else "sampling_param:" + name

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        **kwargs: Any,
    ) -> Any:
        link = self._trace_proxy_link
        run = CURRENT_RUN.get()
        why = "no_trajectory" if run is None else None
        why = why or self._http_unsupported(
            image_data, video_data, audio_data, mm_processor_kwargs, sampling_params, kwargs
        )
        if why is None:
            assert run is not None
            output = await self._through_proxy(request_id, prompt_ids, sampling_params, run, kwargs)
            if output is not None:
                return output
        else:
            link.fell_back(why)
        return await super().generate(  # type: ignore[misc]
            request_id,
            prompt_ids=prompt_ids,
            sampling_params=sampling_params,
            image_data=image_data,
            video_data=video_data,
            audio_data=audio_data,
            mm_processor_kwargs=mm_processor_kwargs,
            **kwargs,
        )

    async def _through_proxy(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        run: Any,
        kwargs: dict[str, Any],
    ) -> Any:
        """verl's TokenOutput, or None when verl's own path must run instead."""
        from verl.utils import normalize_token_ids
        from verl.workers.rollout.replica import TokenOutput

        link = self._trace_proxy_link
        prompt_ids = normalize_token_ids(prompt_ids)
        server_id, server = await self._acquire_server(  # type: ignore[attr-defined]
            request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs
        )
        try:
            route = link.route(server_id)
            if route is None or not link.usable(route):
                link.fell_back("no_proxy_for_server" if route is None else "proxy_unreachable")
                return None
            admitted = await admit(server, link.gates, server_id)
            if admitted.rejected:  # as verl's server answers behind a rejecting gate
                return TokenOutput(token_ids=[], log_probs=None, routed_experts=None,
                                   stop_reason="aborted",
                                   extra_fields=_versioned({}, admitted.version))  # fmt: skip
            priority = int(kwargs.get("priority", 0) or 0)
            if self.config.actor_rollout_ref.rollout.name != "vllm":  # type: ignore[attr-defined]
                priority = 0
            try:
                result = await link.generate(
                    server_id,
                    run.tags,
                    prompt_ids,
                    dict(sampling_params),
                    request_id=self._vllm_request_id(request_id),  # type: ignore[attr-defined]
                    priority=priority,
                    route=route,
                    weight_version=admitted.version,
                )
            except ProxyUnreachable as exc:
                link.mark_down(exc, route)
                return None
            except ServerUnreachable as exc:
                link.fell_back("server_unreachable_over_http", str(exc))
                return None
            run.generates += 1
            run.admin_urls.add(route.admin_url)
        finally:
            self._release_server(server_id, request_id=request_id)  # type: ignore[attr-defined]
        extra_fields: dict[str, Any] = {"global_steps": admitted.version}
        if link.limits.engine == "vllm":
            extra_fields["num_cached_tokens"] = result.num_cached_tokens
        if result.stop_reason == "aborted" and not result.token_ids:
            output = TokenOutput(token_ids=[], log_probs=None, routed_experts=None,
                                 stop_reason="aborted", extra_fields=extra_fields)  # fmt: skip
        else:
            output = TokenOutput(
                token_ids=result.token_ids,
                log_probs=result.log_probs,
                routed_experts=None,
                stop_reason=result.stop_reason,
                extra_fields=extra_fields,
            )
        _versioned(output.extra_fields, admitted.version)
        return output


def _versioned(extra_fields: dict[str, Any], version: Any) -> dict[str, Any]:
    """verl's client's own bookkeeping: `global_steps`, and min and max of one attempt."""
    extra_fields.setdefault("global_steps", version)
    extra_fields.setdefault("min_global_steps", version)
    extra_fields.setdefault("max_global_steps", version)
    return extra_fields


def install(client: Any, link: ProxyLink) -> Any:
    """Put the HTTP hop under `client`'s own class, in place; returns the client."""
    from verl.workers.rollout.llm_server import LLMServerClient

    cls = type(client)
    if isinstance(client, TracedGenerate):
        client._trace_proxy_link = link
        return client
    if cls is LLMServerClient:
        traced: type = type("TracedLLMServerClient", (TracedGenerate, LLMServerClient), {})
    else:
        inner = type("TracedLLMServerClient", (TracedGenerate, LLMServerClient), {})
        traced = type("Traced" + cls.__name__, (cls, inner), {})
    client.__class__ = traced
    client._trace_proxy_link = link
    return client
