"""vLLM's scheduler, telling workers each new request's ``cache_salt``.

The suffix source's global index isolates past responses by ``(cache_salt, LoRA
adapter)`` (``eagle_vllm/drafting/suffix.py`` says why), and the salt lives on the
scheduler's ``Request``: vLLM 0.32's ``NewRequestData`` does not carry it to the workers.
This scheduler attaches it to each new request's data (a plain dataclass, so the
attribute travels with it to worker processes). Selected with ``scheduler_cls`` by
configs whose suffix source keeps past responses (``config.py``).
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler


class SaltCarryingScheduler(Scheduler):
    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        for data in out.scheduled_new_reqs:
            request = self.requests.get(data.req_id)
            data.cache_salt = None if request is None else request.cache_salt
        return out
