"""djl-serving's schema: ``{"inputs" | "messages", "parameters", "stream"}`` requests
(:mod:`.request`) and the output formatters of its token stream (:mod:`.formatters`).
"""
