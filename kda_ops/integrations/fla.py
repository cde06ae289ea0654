def patches():
    return []
