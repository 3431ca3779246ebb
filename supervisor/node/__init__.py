"""The node runtime: what a node is, and what a node needs before a tree runs on it.

- :mod:`.topology`: GPUs, NVLink domain and topology address, discovered from
  ``nvidia-smi``, and the Ray resources and labels that register them;
- :mod:`.placement`: deterministic bundle order, so model-parallel groups never silently
  span domains;
- :mod:`.numa`: binding a GPU worker to its GPU's local CPUs and memory (as an actor init
  hook, ``ERLAY_ACTOR_INIT``);
- :mod:`.jitcache`: seeding and archiving the JIT and compile caches;
- :mod:`.versions`: the stack's versions per node, and the check that they agree;
- :mod:`.commands`: ``erlay topology``.

Contract: the OTP core (the modules directly in :mod:`erlay.supervisor`) never imports this
package; a job wires it in.

May import: erlay.supervisor.
"""
