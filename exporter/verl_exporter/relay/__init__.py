"""verl-exporter relay: Alertmanager webhooks → DingTalk and WeCom group robots.

Alertmanager has no DingTalk receiver, and its WeChat receiver speaks the WeCom *app* API, not the group
robot. The relay takes Alertmanager's webhook, routes each alert to robot targets, formats safe messages
within the robots' size limits, and delivers them within their rate limits, retrying what can be retried
and spooling what is left at shutdown. A console target formats exactly as a robot and shows the message
instead of sending it; ``--preview`` does that for one payload without starting the relay.

May import: core/ and spec/.
"""

from .cli import add_parser, main, run

__all__ = ["add_parser", "main", "run"]
