"""Model building blocks: normalisation, rotary embedding, paged attention, linear layers."""
