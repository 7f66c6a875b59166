"""The RL core, free of Lightning: one RL step as four stages and what they share.

    collect      Environment × RolloutEngine → trajectories and rewards      collect/, envs/, engines/, rewards/
    advantage    estimator(rollout) → Â per row or per token                  advantages.py
    learn        old-policy snapshot, K epochs × M minibatches of updates      learn/, objectives/
    (around it)  settings (config.py), the batch and fp32 log-probs (rollout.py), greedy evaluation (evaluate.py),
                 the supervised warm start (warm_start.py), rollout files for ``lit-gspo compare`` (rollout_io.py)

Nothing here imports Lightning (``tests/test_architecture.py``): the Lightning adapter is ``lit_gspo.lightning``.
"""
