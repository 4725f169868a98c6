"""An OpenEnv environment for tests/test_multiturn.py (imported only in the subprocess that
test starts; see the note there): three guesses, each turn's reward 0.5, the episode ends at
the third guess or at the guess "7"."""

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    message: str = ""


class GuessEnv(Environment):
    def __init__(self, greeting: str = "Guess a digit."):
        super().__init__()
        self.greeting, self.turns = greeting, 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.turns = 0
        return GuessObservation(message=self.greeting)

    def step(self, action, timeout_s=None, **kwargs):
        self.turns += 1
        done = self.turns >= 3 or action.message.strip() == "7"
        return GuessObservation(message="no, again", done=done, reward=0.5)

    @property
    def state(self):
        return State(step_count=self.turns)
