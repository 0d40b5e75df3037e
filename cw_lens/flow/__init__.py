"""Flow: residual-stream shares, rollout, routes, their block capture and checks, evaluation.

`geometry` (pure tensor math of the flow quantities), `capture` (one block at a time, checked
against the model), `shares`, `rollout`, `routes` and `evaluation` (rollout deletion,
route faithfulness). Beside `interactive`, below the reproduction layer (see
`docs/architecture.md`).
"""
