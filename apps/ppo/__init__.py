"""PPO app: the RL app of :mod:`apps.grpo` with a critic role (``python -m apps.ppo.main``)."""
