"""An OpenEnv environment server written with openenv-core's own server classes, for tests: reverse a word.

    python tests/_openenv_server.py PORT

reset(seed) shows a word drawn from the seed; the action is {"message": str}; a message equal to the reversed
word ends the episode with reward 1, anything else is answered "wrong" (reward 0) until the 3rd try ends it.
"""

import random
import sys

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field


class MessageAction(Action):
  message: str = Field(description="the reversed word")


class WordObservation(Observation):
  prompt: str = Field(default="")


class ReverseEnvironment(Environment):
  SUPPORTS_CONCURRENT_SESSIONS = True

  def __init__(self):
    super().__init__()
    self.word, self.tries, self._state = "", 0, State(episode_id=None, step_count=0)

  def reset(self, seed=None, episode_id=None, **kwargs):
    rng = random.Random(seed)
    self.word = "".join(rng.choice("abcdef") for _ in range(3))
    self.tries, self._state = 0, State(episode_id=episode_id, step_count=0)
    return WordObservation(prompt=f"reverse {self.word}", done=False, reward=None)

  def step(self, action, timeout_s=None, **kwargs):
    self.tries += 1
    self._state = State(episode_id=self._state.episode_id, step_count=self.tries)
    right = action.message.strip() == self.word[::-1]
    return WordObservation(prompt="right" if right else "wrong", done=right or self.tries >= 3,
                           reward=1.0 if right else 0.0)

  @property
  def state(self):
    return self._state


if __name__ == "__main__":
  import uvicorn
  app = create_app(ReverseEnvironment, MessageAction, WordObservation, env_name="reverse", max_concurrent_envs=32)
  uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
