"""The RL loop, without Ray: what one step does and the order of steps.

- ``step``: one RL step (generate, grade, score, train, sync) over the protocols of ``protocol``;
- ``loop``: the synchronous and asynchronous orders of steps, with their off-policy bound;
- ``warmup``: the steps before the first; ``validation``: held-out evaluation;
- ``faults``: fault drills and how a step recovers from a lost actor.

It drives whatever implements ``protocol``: the Ray actors of ``workers.job`` in a job, in-process
engines in tests.
"""
