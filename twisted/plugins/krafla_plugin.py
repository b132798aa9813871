"""twistd's entry to krafla: `twistd [-n] krafla [options] [MODEL.mlb]` (options in krafla_twisted/tap.py)."""

from twisted.application.service import ServiceMaker

krafla = ServiceMaker(
    "krafla", "krafla_twisted.tap", "An OpenAI-compatible language model server on your own CPU.", "krafla"
)
