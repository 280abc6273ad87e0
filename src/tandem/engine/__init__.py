"""The inference engine: paged KV cache, scheduler, model, sampler, offline/async APIs."""
