def patches(): return []
