"""Every notebook's exercises and break-it labs.

- lab: the exercises, whose checks refuse wrong answers, and their hints
- pitfalls: each pitfall of the posts run live, broken and then fixed
"""
