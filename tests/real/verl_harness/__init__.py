"""What the verl plugin's real test runs inside verl's venv (Ray, verl's agent loop) and inside
the real vLLM CPU server (a logits processor). Nothing here is imported by the dev venv's tests
except through subprocesses."""

# The one override of verl's config the plugin needs.
PLUGIN_MANAGER = (
    "+actor_rollout_ref.rollout.agent.agent_loop_manager_class="
    "trace_proxy.integrations.verl.AgentLoopManager"
)
