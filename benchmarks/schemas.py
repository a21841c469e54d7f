"""JSON Schemas of real shape (nested objects, enums, arrays with bounds, numbers with ranges), with
one valid instance each: the structured-output benchmarks and tests use them. SCHEMAS[:10] are the
issue's ten; all 20 go into the grammar engines' compile-time comparison."""

from typing import Any

_ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string", "maxLength": 60}, "city": {"type": "string", "maxLength": 40},
    "country": {"type": "string", "enum": ["FR", "DE", "US", "JP", "BR"]},
    "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["street", "city", "country", "postcode"], "additionalProperties": False}

# (name, schema, a valid instance)
SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    ("person", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "maxLength": 60}}, "required": ["name", "age"], "additionalProperties": False},
     {"name": "Ada", "age": 36}),
    ("weather", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "temperature": {"type": "number", "minimum": -90, "maximum": 60},
        "conditions": {"type": "array", "items": {"type": "string", "enum": ["sun", "rain", "snow", "wind", "fog"]},
                       "minItems": 1, "maxItems": 3}},
        "required": ["city", "unit", "temperature", "conditions"], "additionalProperties": False},
     {"city": "Oslo", "unit": "celsius", "temperature": -3.5, "conditions": ["snow"]}),
    ("order", {"type": "object", "properties": {
        "order_id": {"type": "integer", "minimum": 1}, "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40}, "address": _ADDRESS}, "required": ["name", "address"],
            "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0, "maximum": 10000}}, "required": ["sku", "quantity", "price"],
            "additionalProperties": False}},
        "status": {"type": "string", "enum": ["new", "paid", "shipped", "cancelled"]}},
        "required": ["order_id", "customer", "items", "status"], "additionalProperties": False},
     {"order_id": 7, "customer": {"name": "Bo", "address": {"street": "1 Main", "city": "Lyon", "country": "FR",
                                                            "postcode": "69001"}},
      "items": [{"sku": "A1", "quantity": 2, "price": 9.5}], "status": "paid"}),
    ("sentiment", {"type": "object", "properties": {
        "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["label", "score"],
        "additionalProperties": False},
     {"label": "neutral", "score": 0.5}),
    ("event", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 50}, "day": {"type": "integer", "minimum": 1, "maximum": 31},
        "month": {"type": "integer", "minimum": 1, "maximum": 12},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "online": {"type": "boolean"}}, "required": ["title", "day", "month", "online"],
        "additionalProperties": False},
     {"title": "Launch", "day": 3, "month": 11, "attendees": ["Li"], "online": True}),
    ("recipe", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
        "ingredients": {"type": "array", "minItems": 1, "maxItems": 6, "items": {"type": "object", "properties": {
            "item": {"type": "string", "maxLength": 30}, "grams": {"type": "integer", "minimum": 1, "maximum": 2000}},
            "required": ["item", "grams"], "additionalProperties": False}},
        "vegetarian": {"type": "boolean"}}, "required": ["name", "servings", "ingredients", "vegetarian"],
        "additionalProperties": False},
     {"name": "Soup", "servings": 2, "ingredients": [{"item": "leek", "grams": 300}], "vegetarian": True}),
    ("classification", {"type": "object", "properties": {
        "category": {"type": "string", "enum": ["billing", "technical", "account", "other"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "minItems": 0, "maxItems": 4}},
        "required": ["category", "priority", "tags"], "additionalProperties": False},
     {"category": "billing", "priority": 2, "tags": []}),
    ("point_list", {"type": "object", "properties": {
        "points": {"type": "array", "minItems": 2, "maxItems": 5, "items": {"type": "object", "properties": {
            "x": {"type": "number", "minimum": -100, "maximum": 100},
            "y": {"type": "number", "minimum": -100, "maximum": 100}}, "required": ["x", "y"],
            "additionalProperties": False}},
        "closed": {"type": "boolean"}}, "required": ["points", "closed"], "additionalProperties": False},
     {"points": [{"x": 0, "y": 1}, {"x": 2.5, "y": -3}], "closed": False}),
    ("movie", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60}, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genre": {"type": "string", "enum": ["drama", "comedy", "action", "documentary", "animation"]},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "cast": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "actor": {"type": "string", "maxLength": 30}, "role": {"type": "string", "maxLength": 30}},
            "required": ["actor", "role"], "additionalProperties": False}}},
        "required": ["title", "year", "genre", "rating"], "additionalProperties": False},
     {"title": "Up", "year": 2009, "genre": "animation", "rating": 8.2}),
    ("invoice", {"type": "object", "properties": {
        "number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
        "currency": {"type": "string", "enum": ["EUR", "USD", "JPY"]},
        "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "description": {"type": "string", "maxLength": 40},
            "amount": {"type": "number", "minimum": 0, "maximum": 100000}}, "required": ["description", "amount"],
            "additionalProperties": False}},
        "paid": {"type": "boolean"}}, "required": ["number", "currency", "lines", "paid"],
        "additionalProperties": False},
     {"number": "INV-0042", "currency": "EUR", "lines": [{"description": "Work", "amount": 120}], "paid": False}),
    # Ten more for the compile-time comparison.
    ("address", _ADDRESS, {"street": "2 Rue", "city": "Nice", "country": "FR", "postcode": "06000"}),
    ("flags", {"type": "object", "properties": {name: {"type": "boolean"} for name in
                                                ("dark_mode", "beta", "emails", "sms", "tracking")},
               "required": ["dark_mode", "beta"], "additionalProperties": False},
     {"dark_mode": True, "beta": False}),
    ("matrix", {"type": "array", "minItems": 2, "maxItems": 3, "items": {
        "type": "array", "minItems": 2, "maxItems": 3, "items": {"type": "integer", "minimum": -9, "maximum": 9}}},
     [[1, 2], [3, 4]]),
    ("translation", {"type": "object", "properties": {
        "source": {"type": "string", "enum": ["en", "fr", "de", "es"]},
        "target": {"type": "string", "enum": ["en", "fr", "de", "es"]}, "text": {"type": "string", "maxLength": 200}},
        "required": ["source", "target", "text"], "additionalProperties": False},
     {"source": "en", "target": "fr", "text": "bonjour"}),
    ("calendar", {"type": "object", "properties": {"days": {"type": "array", "maxItems": 7, "items": {
        "type": "object", "properties": {"day": {"type": "string", "enum": ["mon", "tue", "wed", "thu", "fri", "sat",
                                                                             "sun"]},
                                          "slots": {"type": "array", "maxItems": 4, "items": {
                                              "type": "integer", "minimum": 0, "maximum": 23}}},
        "required": ["day", "slots"], "additionalProperties": False}}}, "required": ["days"],
        "additionalProperties": False},
     {"days": [{"day": "mon", "slots": [9]}]}),
    ("tree", {"type": "object", "properties": {"value": {"type": "integer"}, "children": {"type": "array", "maxItems": 2,
              "items": {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"],
                        "additionalProperties": False}}}, "required": ["value"], "additionalProperties": False},
     {"value": 1, "children": [{"value": 2}]}),
    ("contact_or_company", {"anyOf": [
        {"type": "object", "properties": {"person": {"type": "string", "maxLength": 30}}, "required": ["person"],
         "additionalProperties": False},
        {"type": "object", "properties": {"company": {"type": "string", "maxLength": 30},
                                          "employees": {"type": "integer", "minimum": 1}},
         "required": ["company"], "additionalProperties": False}]},
     {"company": "Acme", "employees": 10}),
    ("bounding_box", {"type": "object", "properties": {k: {"type": "number", "minimum": 0, "maximum": 1}
                                                       for k in ("x0", "y0", "x1", "y1")},
                      "required": ["x0", "y0", "x1", "y1"], "additionalProperties": False},
     {"x0": 0.1, "y0": 0.2, "x1": 0.5, "y1": 0.9}),
    ("log_entry", {"type": "object", "properties": {
        "level": {"type": "string", "enum": ["debug", "info", "warning", "error"]},
        "code": {"type": "integer", "minimum": 100, "maximum": 599}, "message": {"type": "string", "maxLength": 80},
        "context": {"type": "object", "properties": {"host": {"type": "string", "maxLength": 30},
                                                     "pid": {"type": "integer", "minimum": 1}},
                    "required": ["host"], "additionalProperties": False}},
        "required": ["level", "code", "message"], "additionalProperties": False},
     {"level": "info", "code": 200, "message": "ok"}),
    ("survey", {"type": "object", "properties": {"answers": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "integer", "minimum": 1, "maximum": 5}}, "comment": {"type": "string", "maxLength": 100}},
        "required": ["answers"], "additionalProperties": False},
     {"answers": [1, 5, 3]}),
]
