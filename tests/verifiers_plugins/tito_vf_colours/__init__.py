"""A verifiers 0.4 taskset and Env written for tito's tests (the ``verifiers`` env adapter): the model names a
thing, then the env asks twice more as the user, so every episode is three model calls whatever the model
writes (an episode of ``broken_topic`` raises after the first). Reward: the fraction of the three replies that
are distinct; metric ``replies``. Loaded by verifiers as taskset id ``tito-vf-colours`` (this directory on
PYTHONPATH)."""

import verifiers.v1 as vf

FOLLOW_UPS = ["Another one.", "One more."]


class ColoursConfig(vf.TasksetConfig):
    topics: list[str] = ["colour", "fruit", "animal", "country", "river", "metal"]
    broken_topic: str | None = None  # its episodes raise after the first reply: an env fault


class ColoursTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    pass


class ColoursTaskset(vf.Taskset[ColoursTask, ColoursConfig]):
    def load(self):
        for topic in self.config.topics:
            yield ColoursTask(vf.TaskData(name=f"name-a-{topic}", prompt=f"Name a {topic}. One word."),
                              self.config.task)


class ColoursEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class ColoursEnv(vf.Env[ColoursEnvConfig]):
    async def run(self, task, agents):
        replies = []
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for follow_up in [*FOLLOW_UPS, None]:
                if segment.terminated:
                    break
                replies.append(segment.last_reply)
                if task.data.name == f"name-a-{self.taskset.config.broken_topic}":
                    raise RuntimeError("the game broke")
                if follow_up is None:
                    break
                segment = await interaction.turn(follow_up)
        trace = interaction.trace
        trace.record_reward("distinct", len(set(replies)) / 3)
        trace.record_metric("replies", len(replies))


__all__ = ["ColoursConfig", "ColoursEnv", "ColoursEnvConfig", "ColoursTask", "ColoursTaskset"]
